"""The OpenAI-compatible HTTP API over one engine session: /health, /v1/models, /v1/chat/completions,
/v1/completions (with ``echo`` and prompt log-probs), /v1/responses (``areno.serve.responses``), vLLM's /tokenize,
/detokenize and /tokenizer_info, /version and Prometheus /metrics, with server-sent-event streaming, log-probs, tool
calls and OpenAI-style errors (unknown routes and methods included).

This module builds the app: its shared state (``areno.serve.state``), the middleware (API key, body size), the
error handlers (``areno.serve.errors``) and the routes (``areno.serve.routes``)."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from areno.engine.async_engine import AsyncEngine
from areno.serve.errors import APIError, add_error_handlers, error_response
from areno.serve.limits import DEFAULT_MAX_REQUEST_BYTES, RequestBodyLimit
from areno.serve.responses.route import add_responses_routes
from areno.serve.responses.store import DEFAULT_MAX as DEFAULT_RESPONSES_STORE_MAX
from areno.serve.routes import add_routes
from areno.serve.state import ServeState

__all__ = ["create_app"]

# routes that need the API key when --api-key is set (besides everything under /v1)
PROTECTED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class BearerAuth:
    """``Authorization: Bearer <key>`` on ``/v1`` routes and the tokenizer routes, as plain ASGI middleware:
    Starlette's ``BaseHTTPMiddleware`` would pipe every streamed chunk through an extra task and memory stream (a
    third of the event loop's time per token under load)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in PROTECTED_PATHS):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if header != self.expected:
                response = error_response(APIError(401, "invalid or missing API key", type="authentication_error",
                                                   code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def lifespan(app):
    yield
    await app.state.serve.close()  # after uvicorn has drained (or given up on) the connections


def create_app(engine: AsyncEngine, tokenizer, *, model_name: str, max_model_len: int, api_key: str | None = None,
               max_running: int = 256, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, media=None,
               tool_format=None, loras=None, responses_store_max: int = DEFAULT_RESPONSES_STORE_MAX) -> FastAPI:
    """``media``: a ``ChatMedia`` for chat messages with image/audio/video parts (without one they get a 400);
    ``tool_format``: the ``ToolFormat`` tool calls are read in (Qwen3's when None); ``loras``: the LoRA adapters the
    engine serves (``areno.serve.lora.ServedAdapters``), None without LoRA slots; ``responses_store_max``: how many
    responses /v1/responses keeps (--responses-store-max)."""
    state = ServeState(engine, tokenizer, model_name=model_name, max_model_len=max_model_len,
                       max_running=max_running, media=media, tool_format=tool_format, loras=loras)

    app = FastAPI(title="areno", version="1", lifespan=lifespan)
    app.state.serve = state
    app.state.engine, app.state.prompt_encoder, app.state.metrics = engine, state.prompt_encoder, state.metrics
    app.add_middleware(RequestBodyLimit, limit=max_request_bytes, on_large=state.after_large_request)
    add_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    add_routes(app, state)
    add_responses_routes(app, responses_store_max)
    return app
