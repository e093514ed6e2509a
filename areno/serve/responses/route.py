"""``POST /v1/responses`` (whole or streamed), ``GET`` and ``DELETE /v1/responses/{id}``. A Responses request is
translated into a chat-completions body and run through the chat route itself (``areno.serve.routes.chat.chat``:
its template rendering, sampling, grammar, tool-call reading and streaming), and its answer, whole or chunk by chunk,
is read back as output items (``areno.serve.responses.output``). Errors of the chat path name the Responses
fields (``input``, ``max_output_tokens``, ``text.format``)."""

from __future__ import annotations

import json
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from areno.serve.bodies import json_body, request_body
from areno.serve.errors import APIError
from areno.serve.protocol import parse
from areno.serve.responses.output import OutputBuilder, ThinkSplitter, new_id, response_object, response_usage
from areno.serve.responses.protocol import ResponsesRequest, chat_body, chat_messages
from areno.serve.responses.store import ResponseStore
from areno.serve.routes.chat import chat

# chat-completions names -> the Responses request's
CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort"}
FINISH_STATUS = {"length": ("incomplete", "max_output_tokens"), "abort": ("incomplete", None)}


class ChatCall:
    """The incoming request as the chat route sees it: the same app and connection, the translated body."""

    def __init__(self, request: Request, body: dict):
        self.request, self.app, self.headers = request, request.app, request.headers
        self.raw = json.dumps(body, ensure_ascii=False).encode()

    async def body(self) -> bytes:
        return self.raw

    async def is_disconnected(self) -> bool:
        return await self.request.is_disconnected()


def responses_error(exc: APIError) -> APIError:
    """A chat-path error in the Responses request's terms (its param and message name the Responses field)."""
    param, message = exc.param, exc.message
    if isinstance(param, str):
        head, dot, rest = param.partition(".")
        param = CHAT_PARAMS.get(head, head) + dot + rest
    for chat_name, name in CHAT_PARAMS.items():
        message = message.replace(chat_name, name)
    return APIError(exc.status, message, type=exc.type, param=param, code=exc.code)


class AnswerReader:
    """The chat answer's message (whole) or deltas (streamed) -> output items, through one ``OutputBuilder``."""

    def __init__(self, think: bool, events: bool):
        self.builder, self.splitter = OutputBuilder(events), ThinkSplitter(think)
        self.finish: str | None = None
        self.usage = (0, 0)

    def _text(self, pieces) -> None:
        for kind, text in pieces:
            (self.builder.reasoning if kind == "reasoning" else self.builder.text)(text)

    def piece(self, delta: dict) -> None:
        if delta.get("reasoning_content"):
            self.builder.reasoning(delta["reasoning_content"])
        if delta.get("content"):
            self._text(self.splitter.push(delta["content"]))
        for j, tc in enumerate(delta.get("tool_calls") or ()):
            self._text(self.splitter.finish())
            fn = tc.get("function") or {}
            self.builder.call(tc.get("index", j), tc.get("id"), fn.get("name"), fn.get("arguments"))

    def chunk(self, obj: dict) -> None:
        """One chat.completion.chunk."""
        if obj.get("usage"):
            self.usage = (obj["usage"]["prompt_tokens"], obj["usage"]["completion_tokens"])
        for choice in obj.get("choices") or ():
            self.piece(choice.get("delta") or {})
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def end(self) -> tuple[str, str | None]:
        """Everything held written out, the last item closed: (the response's status, why it is incomplete)."""
        self._text(self.splitter.finish())
        status, why = FINISH_STATUS.get(self.finish, ("completed", None))
        self.builder.close(status)
        return status, why


class Responder:
    """One create call: the parsed request, the conversation it continues, its id; stores the answer."""

    def __init__(self, state, store: ResponseStore, req: ResponsesRequest):
        self.req, self.store, self.rid, self.created = req, store, new_id("resp"), time.time()
        history = []
        if req.previous_response_id is not None:
            prev = store.get(req.previous_response_id)
            if prev is None:
                raise APIError(400, f"Previous response with id '{req.previous_response_id}' not found (never stored,"
                               " deleted, or dropped from the store by count or age)", param="previous_response_id",
                               code="previous_response_not_found")
            history = prev.messages
        self.history = history
        self.think = "</think>" in state.template_text and not state.tool_format.always_read

    def chat_body(self) -> dict:
        return chat_body(self.req, self.history)

    def response(self, reader: AnswerReader, status: str, why: str | None = None, error: dict | None = None) -> dict:
        usage = response_usage(*reader.usage) if status != "in_progress" else None
        return response_object(self.rid, self.req, self.created, reader.builder.items, status=status, usage=usage,
                               incomplete=why, error=error)

    def keep(self, response: dict, reader: AnswerReader) -> None:
        if self.req.store:
            conversation = self.history + chat_messages(self.req.input_items())
            self.store.put(response, [*conversation, reader.builder.assistant_message()])

    def whole(self, answer: dict) -> dict:
        reader = AnswerReader(self.think, events=False)
        choice = answer["choices"][0]
        reader.piece(choice["message"])
        reader.finish = choice["finish_reason"]
        reader.usage = (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"])
        response = self.response(reader, *reader.end())
        self.keep(response, reader)
        return response

    async def events(self, chunks):
        """The chat route's SSE chunks -> the Responses stream's events."""
        reader = AnswerReader(self.think, events=True)
        b = reader.builder
        b.event("response.created", response=self.response(reader, "in_progress"))
        b.event("response.in_progress", response=self.response(reader, "in_progress"))
        try:
            for text in b.drain():
                yield text
            async for sse in chunks:
                for line in sse.splitlines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[len("data: "):])
                    if "error" in obj:
                        for text in self.failed(reader, obj["error"]):
                            yield text
                        return
                    reader.chunk(obj)
                for text in b.drain():
                    yield text
            status, why = reader.end()
            response = self.response(reader, status, why)
            self.keep(response, reader)
            b.event("response.completed" if status == "completed" else "response.incomplete", response=response)
            for text in b.drain():
                yield text
        finally:
            await chunks.aclose()

    def failed(self, reader: AnswerReader, error: dict) -> list[str]:
        b = reader.builder
        b.close("incomplete")
        b.event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
        b.event("response.failed", response=self.response(
            reader, "failed", error={"code": "server_error", "message": error.get("message") or "failed"}))
        return b.drain()


async def create(request: Request):
    state = request.app.state.serve
    req = await state.prep(parse, await json_body(request), ResponsesRequest)
    state.check_model(req.model)
    responder = Responder(state, request.app.state.responses, req)
    try:
        answer = await chat(ChatCall(request, responder.chat_body()))
    except APIError as exc:
        raise responses_error(exc) from exc
    if req.stream:
        return StreamingResponse(responder.events(answer.body_iterator), media_type="text/event-stream")
    return responder.whole(answer)


def not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found (never stored, deleted, or dropped from the store by "
                    "count or age)", param="response_id", code="not_found")


async def retrieve(request: Request, response_id: str):
    stored = request.app.state.responses.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored.response


async def delete(request: Request, response_id: str):
    if not request.app.state.responses.delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def add_responses_routes(app, store_max: int) -> None:
    """The routes on ``app``, and the store they keep responses in (``app.state.responses``)."""
    app.state.responses = ResponseStore(store_max)
    app.add_api_route("/v1/responses", create, methods=["POST"], openapi_extra=request_body(ResponsesRequest))
    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
