"""The local OpenAI-compatible chat endpoint agents call during agentic rollout (``areno.rl.agentic``).

``POST /v1/chat/completions`` (non-streaming, ``n=1``): the session named by the ``X-Areno-Session`` header (or the
request's ``user`` field) appends the request's new messages to its token sequence, samples one answer on the
colocated engine and returns it as an OpenAI chat completion, tool calls parsed from ``<tool_call>`` blocks. A
conversation past ``--max-context-len`` gets HTTP 400 ``context_length_exceeded``; an answer cut by the limit ends
with ``finish_reason: "length"``. ``GET /v1/models`` names the policy.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areno.rl.agentic.session import SESSION_HEADER, AgentError

MODEL = "policy"


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": code}}, status_code=status)


def create_app(rollout) -> FastAPI:
    app = FastAPI(title="areno agent endpoint")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "areno"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if request.headers.get("authorization", "") != f"Bearer {rollout.api_key}":
            return _error(401, "wrong or missing API key (use ctx.api_key)", "invalid_api_key")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_json")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "messages must be a non-empty list", "invalid_value", "messages")
        if body.get("stream"):
            return _error(400, "streaming is not supported by the agent endpoint", "unsupported", "stream")
        if body.get("n", 1) != 1:
            return _error(400, "n must be 1 (one session is one trajectory)", "unsupported", "n")
        name = request.headers.get(SESSION_HEADER) or body.get("user")
        session = rollout.sessions.get(name)
        if session is None:
            return _error(400, f"no agent session {name!r}: use ctx.client(item), or send the {SESSION_HEADER} "
                          "header (or `user`) with item.id", "unknown_session", "user")
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        async with session.lock:
            try:
                session.extend_messages(body["messages"], tools)
            except AgentError as e:
                return _error(400, str(e), e.code, e.param)
            message = await rollout.sample(
                session, max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
                temperature=body.get("temperature"), top_p=body.get("top_p"), stop=body.get("stop"),
                assistant_message=True)
        finish = session.finish_reason
        if message.get("tool_calls") and finish == "stop":
            finish = "tool_calls"
        prompt_tokens = len(session.tokens) - session.mask.count(1)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": MODEL,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": session.mask.count(1),
                          "total_tokens": len(session.tokens)}}

    return app
