"""The local OpenAI-compatible chat endpoint agents call during agentic rollout (``areno.rl.agentic``).

``POST /v1/chat/completions`` (non-streaming, ``n=1``): the session named by the ``X-Areno-Session`` header (or the
request's ``user`` field) appends the request's new messages to its token sequence, samples one answer on the
colocated engine and returns it as an OpenAI chat completion, tool calls read in the policy's format under the
request's ``tool_choice`` exactly as ``areno serve`` does (``areno.engine.tool_calls.choice``: "required" and a named
function run under the call grammar, "none" hides the tools and cuts call markup, only declared functions return;
a request that declares no tools gets every call the policy writes, as before: an agent may name its tools in the
prompt instead, as the agentic quickstart does). A
conversation past ``--max-context-len`` gets HTTP 400 ``context_length_exceeded`` (and ends its sample); an answer
cut by the limit ends with ``finish_reason: "length"``. Messages the chat template cannot render, media parts and
sampling settings the engine refuses are 400s naming the parameter, never a 500. ``GET /v1/models`` names the policy.

Bodies are validated as ``areno serve`` validates them (``areno.serve.protocol.ChatCompletionRequest``; ``model``
may be left out) and every error has its OpenAI body (``areno.serve.errors``). The endpoint samples with the
request's ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p`` and ``stop`` over the run's
settings; other sampling fields are accepted and ignored (logged once each).
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from areno.config import ConfigError
from areno.rl.agentic.session import SESSION_HEADER
from areno.serve.errors import APIError, add_error_handlers
from areno.serve.protocol import ChatCompletionRequest, Notes, load_json, validate

MODEL = "policy"
# the request fields the endpoint reads (the others are validated, then ignored)
USED_FIELDS = frozenset({"model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
                         "temperature", "top_p", "stop", "stream", "n", "user"})


class AgentChatRequest(ChatCompletionRequest):
    """``ChatCompletionRequest`` with ``model`` optional: the endpoint serves one model, the policy."""

    model: str = MODEL


def check_request(req: AgentChatRequest, note: Notes) -> None:
    """What the endpoint refuses beyond the schema (streaming, n > 1), and a note on each field it ignores."""
    if req.stream:
        raise APIError(400, "streaming is not supported by the agent endpoint", param="stream", code="unsupported")
    if req.n != 1:
        raise APIError(400, "n must be 1 (one session is one trajectory)", param="n", code="unsupported")
    if req.has_media():
        raise APIError(400, "the agent endpoint takes text messages only (this request has an image, audio or video "
                       "part)", param="messages", code="unsupported")
    fields = AgentChatRequest.model_fields
    for name in sorted(req.model_fields_set - USED_FIELDS):
        if getattr(req, name) != fields[name].default:
            note(name, "it samples with the run's settings")


def create_app(rollout) -> FastAPI:
    """The endpoint over ``rollout`` (an ``AgentRollout``: ``api_key``, ``sessions``, ``sample``)."""
    app = FastAPI(title="areno agent endpoint")
    add_error_handlers(app)
    note = Notes(" by the agent endpoint")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "areno"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if request.headers.get("authorization", "") != f"Bearer {rollout.api_key}":
            raise APIError(401, "wrong or missing API key (use ctx.api_key)", type="authentication_error",
                           code="invalid_api_key")
        body = load_json(await request.body())
        req = validate(body, AgentChatRequest)
        check_request(req, note)
        name = request.headers.get(SESSION_HEADER) or req.user
        session = rollout.sessions.get(name)
        if session is None:
            raise APIError(400, f"no agent session {name!r}: use ctx.client(item), or send the {SESSION_HEADER} "
                           "header (or `user`) with item.id", param="user", code="unknown_session")
        plan = req.plan_tools(rollout.tool_format)  # tool_choice as areno serve runs it (a grammar where forced)
        tools = body.get("tools") if plan.shown else None
        async with session.lock:  # the messages and tools as sent (validated above) go to the chat template
            extend(session, body["messages"], tools)
            try:
                message = await rollout.sample(
                    session, max_tokens=req.max_completion_tokens or req.max_tokens, temperature=req.temperature,
                    top_p=req.top_p, stop=req.stop, assistant_message=True, tools=tools,
                    plan=plan if body.get("tools") or req.tool_choice == "none" else None)
            except ConfigError as exc:  # a sampling setting the engine refuses: the request's mistake
                raise APIError(400, str(exc), param=exc.flag) from exc
        return completion(session, message)

    return app


def extend(session, messages, tools) -> None:
    """The session's turn with ``messages``; a history the chat template cannot render (it raised) is a 400."""
    try:
        session.extend_messages(messages, tools)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, a template's raise_exception, a TypeError
        raise APIError(400, f"messages could not be rendered with the chat template: {type(exc).__name__}: {exc}",
                       param="messages") from exc


def completion(session, message: dict) -> dict:
    """The chat completion of ``session``'s last answer ``message``."""
    finish = session.finish_reason
    if message.get("tool_calls") and finish == "stop":
        finish = "tool_calls"
    prompt_tokens = len(session.tokens) - session.mask.count(1)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": session.mask.count(1),
                      "total_tokens": len(session.tokens)}}
