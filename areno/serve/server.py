"""``areno serve``: load the model once, open one engine session for the server's lifetime, serve HTTP.

SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish for up to ``GRACEFUL_SHUTDOWN_S``
seconds (``ARENO_SERVE_GRACEFUL_SHUTDOWN_S`` overrides it), then aborts what is left, so every client gets a
response that ends cleanly (``finish_reason: "abort"``, then ``[DONE]`` when streaming), closes the engine and exits 0.
A second SIGTERM or SIGINT during that drain cuts it short: the in-flight requests are aborted at once (the same
clean end), and the process exits with 128 + that signal's number (143 for SIGTERM, 130 for SIGINT), saying the
stop was not graceful. A third signal stops waiting for the aborted responses to reach their clients.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import threading

from areno.config.env import env_value

log = logging.getLogger("areno.serve")

GRACEFUL_SHUTDOWN_S = 30.0
ABORT_FLUSH_S = 5.0  # after the abort, time for the aborted responses to reach their clients


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def serve_tool_format(config):
    """The ``ToolFormat`` of --tool-call-format, or (auto) of the checkpoint's model_type."""
    from areno.engine.tool_calls import format_for
    from areno.models.loader import read_config, resolve_model_path

    if config.tool_call_format != "auto":
        return format_for(None, config.tool_call_format)
    return format_for(read_config(resolve_model_path(config.model_path)).get("model_type"))


def build_app(config, *, model=None, tokenizer=None):
    """The FastAPI app and its engine front end for a ServeConfig: a ReplicaPool of --world-size / --tp-size
    engine-core processes (one by default: the engine never shares this process's interpreter lock with HTTP,
    detokenisation and SSE encoding), or, with --engine-thread, under a --world-size == --tp-size > 1 launch (TP
    rank 0 holds the engine) or when tests pass ``model``/``tokenizer`` objects, an AsyncEngine (``ServeEngine``)
    on an engine thread in this process."""
    from areno.engine.build import build_engine
    from areno.models.multimodal import MediaLimits
    from areno.serve.app import create_app
    from areno.serve.lora import served_adapters
    from areno.serve.media import ChatMedia
    from areno.serve.replicas import build_pool, check_topology, visible_gpus
    from areno.serve.scoring import ServeEngine

    name = config.served_model_name or str(config.model_path).rstrip("/")
    media = ChatMedia(config.model_path, MediaLimits(max_image_bytes=config.max_image_bytes,
                                                     max_image_pixels=config.max_image_pixels,
                                                     max_images=config.max_images_per_prompt),
                      max_request_pixels=config.max_request_pixels)
    tool_format = serve_tool_format(config)
    replicas = check_topology(config.world_size, config.tp_size, len(visible_gpus()))
    if config.engine_thread and replicas > 1:
        from areno.config import ConfigError

        raise ConfigError("--engine-thread", f"puts one engine in the HTTP process; {replicas} replicas "
                          "(--world-size / --tp-size) each run in their own process")
    in_process = config.engine_thread or config.tp_size > 1 or model is not None
    loras = served_adapters(config)  # --lora-modules: each engine loads them as it starts
    if replicas > 1 or not in_process:
        from areno.models import load_tokenizer

        tokenizer = tokenizer or load_tokenizer(config.model_path)
        pool = build_pool(config, replicas)
        app = create_app(pool, tokenizer, model_name=name, max_model_len=pool.max_model_len,
                         api_key=config.api_key, max_running=config.max_running_prompts,
                         max_request_bytes=config.max_request_bytes, media=media,
                         tool_format=tool_format, loras=loras, responses_store_max=config.responses_store_max)
        return app, pool

    engine, tokenizer = build_engine(
        config.model_path, model=model, tokenizer=tokenizer, tp_size=config.tp_size,
        max_running=config.max_running_prompts, max_model_len=config.max_model_len,
        eager_decode=config.eager_decode, attn_backend=config.attn_backend,
        decode_progress_interval_s=config.decode_progress_interval_s or None, dtype=config.dtype,
        seed=config.seed, kv_cache_memory=config.kv_cache_memory, rollout_dtype=config.rollout_dtype,
        kv_cache_dtype=config.kv_cache_dtype, mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype,
        **config.lora_engine_kwargs(),
    )
    engine.capture_graphs((1,))  # every decode bucket before the first request: no capture stalls a request later
    engine.warm_up()  # nor a JIT compile or an autotune of an eager (prefill or mixed) step
    aengine = ServeEngine(engine)
    app = create_app(aengine, tokenizer, model_name=name, max_model_len=engine.max_model_len,
                     api_key=config.api_key, max_running=config.max_running_prompts,
                     max_request_bytes=config.max_request_bytes, media=media,
                     tool_format=tool_format, loras=loras, responses_store_max=config.responses_store_max)
    return app, aengine


def load_failure(config, exc: BaseException) -> Exception:
    """The one-line error for a model that would not load (a bad folder, a wrong config, corrupt weights: a
    ConfigError naming --model-path, exit 2), or a RunError (exit 1) where the machine ran out of memory."""
    from areno.config import ConfigError, RunError

    text = " ".join(f"{type(exc).__name__}: {exc}".split())  # tokenizer and replica errors span several lines
    text = text if len(text) <= 400 else text[:397] + "..."
    if isinstance(exc, MemoryError) or "OutOfMemoryError" in text:
        return RunError(f"--model-path {config.model_path} did not fit in memory: {text}")
    return ConfigError("--model-path", f"{config.model_path} could not be loaded: {text}")


def load_app(config):
    """``build_app``, with any failure to load the model as one line (``load_failure``) instead of a traceback."""
    from areno.config import ConfigError, RunError

    try:
        return build_app(config)
    except (ConfigError, RunError):
        raise
    except Exception as exc:  # noqa: BLE001 - every load failure becomes one line naming the flag
        log.debug("load failure", exc_info=True)
        raise load_failure(config, exc) from None


def graceful_shutdown_s() -> float:
    raw = env_value("ARENO_SERVE_GRACEFUL_SHUTDOWN_S")
    if raw is None:
        return GRACEFUL_SHUTDOWN_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise SystemExit(f"areno serve: error: ARENO_SERVE_GRACEFUL_SHUTDOWN_S must be seconds >= 0, got {raw!r}")
    return value


def _make_server(app, engine, config, window: float):
    """A uvicorn server whose first SIGTERM/SIGINT starts a timer that aborts the engine's requests at ``window``:
    uvicorn drains connections but would cancel a still-streaming response mid-body; the abort ends it cleanly.
    A second signal aborts at once (``forced`` keeps its number, for the exit code); a third stops waiting for
    the aborted responses. uvicorn's own second-Ctrl-C "force exit" is never used: it skips the app's shutdown,
    cutting streams mid-body and leaving the engine thread to find its event loop closed."""
    import uvicorn

    class Server(uvicorn.Server):
        timer: threading.Timer | None = None
        forced: int | None = None  # the signal that cut the drain short
        aborter: threading.Thread | None = None

        def handle_exit(self, sig, frame):
            force_exit = self.force_exit
            super().handle_exit(sig, frame)
            self.force_exit = force_exit
            if self.timer is None:
                log.info("signal %d: draining in-flight requests for up to %.0f s", sig, window)
                self.timer = threading.Timer(window, self._abort, args=("graceful shutdown window over",))
                self.timer.daemon = True
                self.timer.start()
            elif self.forced is None:
                self.forced = sig
                self.timer.cancel()
                self.aborter = threading.Thread(target=self._abort, args=(f"signal {sig} during the drain",),
                                                daemon=True)
                self.aborter.start()
                # aborted responses end in milliseconds; a client that does not read its own holds the exit for
                # ABORT_FLUSH_S at most, not for what is left of the drain window
                flush = threading.Timer(ABORT_FLUSH_S, self._stop_waiting)
                flush.daemon = True
                flush.start()
            else:
                threading.Thread(target=self._stop_waiting, daemon=True).start()

        def _abort(self, why: str):
            if engine.num_active:
                log.warning("%s: aborting %d in-flight requests", why, engine.num_active)
            engine.shutdown(drain=False)

        def _stop_waiting(self):
            """uvicorn's force exit, once the engine has stopped (so nothing it sends finds the loop closed)."""
            self.aborter.join()
            self.force_exit = True

    return Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                 timeout_graceful_shutdown=window + ABORT_FLUSH_S, **connection_options(config)))


def connection_options(config) -> dict:
    """uvicorn settings for --read-timeout-s and --max-connections (``areno.serve.connections``)."""
    from areno.serve.connections import default_max_connections, guarded_protocol

    cap = config.max_connections or default_max_connections()
    return {"http": guarded_protocol(config.read_timeout_s, cap), "backlog": min(2048, cap)}


TP_CONFIG_ENV = "ARENO_SERVE_CONFIG"


def run_server(config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from areno.distributed.launch import launch, launched

    if config.tp_size > 1 and config.world_size == config.tp_size and not launched():
        # one replica over --tp-size ranks: rank 0 serves HTTP and schedules, the others follow its steps
        import json
        from dataclasses import asdict

        os.environ[TP_CONFIG_ENV] = json.dumps(asdict(config))
        return launch("areno.serve.tp_worker", [], config.tp_size, stop_is_success=True)
    if not config.api_key and not _is_loopback(config.host):
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model",
                    config.host)
    window = graceful_shutdown_s()
    app, engine = load_app(config)
    server = _make_server(app, engine, config, window)
    # uvicorn re-raises the signal that stopped it once it is done, under the handlers it found: make those only
    # ask the server to stop, so a graceful stop exits 0 instead of dying by that signal
    previous = {sig: signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        if server.timer is not None:
            server.timer.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if hasattr(engine, "close"):
            engine.close()  # a TP session's followers leave their loop
    if server.forced is not None:
        log.warning("stopped by a second signal (%d) before in-flight requests could finish", server.forced)
        return 128 + server.forced
    return 0
