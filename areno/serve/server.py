"""``areno serve``: load the model once, open one engine session for the server's lifetime, serve HTTP.

SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish for up to
``GRACEFUL_SHUTDOWN_S`` seconds, then aborts what is left, closes the engine and exits 0.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

log = logging.getLogger("areno.serve")

GRACEFUL_SHUTDOWN_S = 30


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def build_app(config, *, model=None, tokenizer=None):
    """The FastAPI app and its AsyncEngine for a ServeConfig (model/tokenizer may be passed in by tests)."""
    from areno.rollout.async_engine import AsyncEngine
    from areno.rollout.session import build_engine
    from areno.serve.app import create_app

    engine, tokenizer = build_engine(
        config.model_path, model=model, tokenizer=tokenizer, tp_size=config.tp_size,
        max_running=config.max_running_prompts, max_model_len=config.max_model_len,
        eager_decode=config.eager_decode, attn_backend=config.attn_backend,
        decode_progress_interval_s=config.decode_progress_interval_s or None, dtype=config.dtype,
        seed=config.seed, kv_cache_memory=config.kv_cache_memory,
    )
    aengine = AsyncEngine(engine)
    name = config.served_model_name or str(config.model_path).rstrip("/")
    app = create_app(aengine, tokenizer, model_name=name, max_model_len=engine.max_model_len,
                     api_key=config.api_key, max_running=config.max_running_prompts)

    @app.on_event("shutdown")
    async def _close():
        aengine.shutdown(drain=False)

    return app, aengine


def run_server(config) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.world_size // config.tp_size > 1:
        raise SystemExit("areno serve: error: --world-size / --tp-size > 1 (data-parallel replicas) needs the "
                         "multi-replica front end, which is not built yet; use --world-size equal to --tp-size")
    if not config.api_key and not _is_loopback(config.host):
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model",
                    config.host)
    app, _ = build_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    server.run()
    return 0
