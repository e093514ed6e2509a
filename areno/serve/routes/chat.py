"""``POST /v1/chat/completions``: the messages rendered through the chat template (media parts through the model's
processor), sampled ``n`` times and answered whole or streamed as ``chat.completion.chunk`` events, with log-probs,
vLLM's ``prompt_logprobs`` and tool calls: ``tools`` and ``tool_choice`` planned in the served tool-call format
(``areno.engine.tool_calls.choice``: the grammar of a forced or strict call), calls read from the text and streamed
as OpenAI streams them (``areno.serve.tool_stream``)."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from areno.engine.tool_calls import read_answer, read_calls
from areno.serve.bodies import json_body, request_body
from areno.serve.chunks import ChunkWriter, json_str, usage
from areno.serve.errors import APIError
from areno.serve.generation import check_request, collect, sampling_options, score_prompts, submit
from areno.serve.logprobs import chat_logprobs
from areno.serve.protocol import ChatCompletionRequest, parse
from areno.serve.render import render_chat
from areno.serve.scoring import vllm_prompt_logprobs
from areno.serve.state import ServeState
from areno.serve.tool_stream import ToolDeltas


def prepare_chat(state: ServeState, raw: bytes):
    """Body -> (request, prompt ids, sampling options, top log-probs): on the prep pool. A request with media parts
    comes back with None for the ids and options: its images are decoded next, within the pixel budget."""
    req = parse(raw, ChatCompletionRequest)
    state.check_model(req.model)
    check_request(state, req)
    req.plan_tools(state.tool_format)
    k = (req.top_logprobs or 0) if req.logprobs else 0
    if req.has_media():  # image parts: the model's processor (expanded placeholders, pixel rows)
        if state.media is None:
            raise APIError(400, "this server takes no image, audio or video parts", param="messages")
        if req.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported yet for prompts with images",
                           param="prompt_logprobs")
        return req, None, None, k
    prompt_ids = state.prompt_encoder(render_chat(state.tokenizer, req), "messages")
    return req, prompt_ids, sampling_options(state, req, len(prompt_ids), req.token_limit(), k), k


async def chat(request: Request):
    state: ServeState = request.app.state.serve
    arrival = time.perf_counter()
    req, prompt_ids, opts, k = await state.prep(prepare_chat, state, await json_body(request))
    mm = None
    if prompt_ids is None:  # image parts: the model's processor (expanded placeholders, pixel rows)
        mm = await state.media.encode(req, state.prep)
        prompt_ids = mm.input_ids
        opts = sampling_options(state, req, len(prompt_ids), req.token_limit(), k)
    read = wants_calls(req) or state.tool_format.always_read  # the answer read whole, in the format, at its end
    stream = await submit(state, prompt_ids, opts, arrival, mm)
    plp = None
    if req.prompt_logprobs is not None:  # vLLM's extension (never streamed): a forward while it decodes
        try:
            (score,) = await score_prompts(state, [prompt_ids], req.prompt_logprobs, ranks=True,
                                           param="prompt_logprobs")
        except BaseException:
            stream.abort()
            raise
        plp = vllm_prompt_logprobs(prompt_ids, score, req.prompt_logprobs, state.token_namer(req))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        writer = ChunkWriter(rid, "chat.completion.chunk", created, state.served_name(req.model),
                             len(prompt_ids), req.stream_options)
        chunks = ChatStream(state, req, writer, read, k).chunks(stream)
        return StreamingResponse(writer.stream(chunks, [stream]), media_type="text/event-stream")
    try:
        out = await collect(request, stream)
    finally:
        stream.abort()
    body = chat_response(state, req, out, read, k)
    completion_tokens = sum(len(o["ids"]) for o in out)
    return {"id": rid, "object": "chat.completion", "created": created, "model": state.served_name(req.model),
            "choices": body, "usage": usage(len(prompt_ids), completion_tokens),
            **({"prompt_logprobs": plp} if plp is not None else {})}


def chat_response(state: ServeState, req, out: list[dict], read: bool, k: int) -> list[dict]:
    """The choices of a whole (non-streamed) answer from each sample's tokens (``read``: in the tool-call format)."""
    choices = []
    name = state.token_namer(req)
    for idx, o in enumerate(out):
        d = state.detokenizer(req)
        d.ids = o["ids"]
        text = d.final_text(o["stop_text"], o["finish"])
        message = {"role": "assistant", "content": text}
        finish = o["finish"] or "abort"
        if read:
            message, finish = tool_answer(state, req, o["ids"], o["stop_text"], finish)
        choices.append({"index": idx, "message": message, "finish_reason": finish,
                        "logprobs": chat_logprobs(o, k, name) if req.logprobs else None})
    return choices


def wants_calls(req) -> bool:
    """Whether the answer is read for tool calls: the request has tools (with ``tool_choice`` "none", to cut their
    markup)."""
    return bool(req.tools)


def tool_answer(state: ServeState, req, ids: list[int], stop_text: str | None, finish: str) -> tuple[dict, str]:
    """An answer read in the served model's tool-call format: (the assistant message with its ``tool_calls`` and
    ``reasoning_content`` where the format found some, the finish reason: ``tool_calls`` when it found calls).
    Only calls to declared functions come back (another stays content); with ``tool_choice`` "none" the call
    markup is cut; with no tools a call leaves the whole text as content."""
    specials = state.special_tokens if req.skip_special_tokens else ()
    text = state.tool_text(req, ids, stop_text, finish)
    if req.tools:
        parsed = read_calls(state.tool_format, text, req.tool_plan, specials)
    else:
        parsed = read_answer(state.tool_format, text, (), specials)
    if parsed.calls and not req.tools:
        d = state.detokenizer(req)
        d.ids = ids
        return {"role": "assistant", "content": d.final_text(stop_text, finish)}, finish
    message = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.calls]
        finish = "tool_calls"
    return message, finish


def _no_logprobs() -> dict:
    return {"ids": [], "logprobs": [], "top": []}


class ChatStream:
    """One streamed chat answer: per sample, its detokenizer and the log-probs of tokens whose text is not sent."""

    def __init__(self, state: ServeState, req, writer: ChunkWriter, read: bool, k: int):
        self.state, self.req, self.writer, self.read, self.k = state, req, writer, read, k
        self.name = state.token_namer(req)
        self.detoks = [state.detokenizer(req) for _ in range(req.n)]
        self.held = [_no_logprobs() for _ in range(req.n)]
        self.tools = [ToolDeltas(state.tool_format, req.tool_plan, state.tokenizer) for _ in range(req.n)] \
            if read else None

    async def chunks(self, stream):
        for i in range(self.req.n):
            yield self.writer.chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None, "logprobs": None})
        async for first in stream:
            # every event already queued goes out with this one: one chunk per sample however far behind
            by_index: dict[int, list] = {}
            for ev in [first, *stream.pending()]:
                by_index.setdefault(ev.index, []).append(ev)
            for index, evs in by_index.items():
                text = self.sample_chunk(index, evs)
                if text is not None:
                    yield text

    def sample_chunk(self, index: int, evs: list) -> str | None:
        """Sample ``index``'s events of one batch as its chunk (None: nothing to show yet)."""
        req, writer = self.req, self.writer
        d, h, last = self.detoks[index], self.held[index], evs[-1]
        got = [ev for ev in evs if ev.token_id is not None]
        ids = [ev.token_id for ev in got]
        writer.completion_tokens += len(ids)
        if last.finish_reason is None:
            delta_text = d.push_many(ids)
        else:  # the last token's text goes out through flush, once the stop string is known
            d.ids.extend(ids)
            delta_text = ""
        if req.logprobs:
            h["ids"] += ids
            h["logprobs"] += [ev.logprob for ev in got]
            h["top"] += [ev.top for ev in got]
        if self.read:
            return self.tool_chunk(index, delta_text, ids if last.finish_reason is None else [], last)
        if last.finish_reason is None and not delta_text:
            return None  # nothing to show yet (held-back text)
        lp = chat_logprobs(h, self.k, self.name) if req.logprobs and h["ids"] else None
        self.held[index] = _no_logprobs()
        if last.finish_reason is None:
            if lp is None and not writer.every:  # the hot path: a template, no dict, no json.dumps
                return writer.plain(index, f'"delta":{{"content":{json_str(delta_text)}}},'
                                           f'"finish_reason":null,"logprobs":null')
            return writer.chunk({"index": index, "delta": {"content": delta_text}, "finish_reason": None,
                                 "logprobs": lp})
        finish = last.finish_reason
        delta = {"content": delta_text + d.flush(last.stop_text, finish)}
        return writer.chunk({"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp})

    def tool_chunk(self, index: int, delta_text: str, ids: list[int], last) -> str | None:
        """Sample ``index``'s chunks when its answer is read for tool calls (``ToolDeltas``): the deltas ready
        now (of the text and tokens, ``ids``, of these events), and at its end the rest and then ``finish_reason``
        in a chunk of its own."""
        tools, writer = self.tools[index], self.writer
        deltas = tools.step(delta_text, ids) if delta_text or ids else []
        lp = None
        if self.req.logprobs and self.held[index]["ids"] and (deltas or last.finish_reason is not None):
            lp = chat_logprobs(self.held[index], self.k, self.name)
            self.held[index] = _no_logprobs()
        if last.finish_reason is not None:
            message, finish = tool_answer(self.state, self.req, self.detoks[index].ids, last.stop_text,
                                          last.finish_reason)
            deltas += tools.finish(message)
            deltas.append(None)  # the finish reason's own chunk
        out = []
        for j, delta in enumerate(deltas):
            choice = {"index": index, "delta": delta if delta is not None else {},
                      "finish_reason": finish if delta is None else None, "logprobs": lp if j == 0 else None}
            out.append(writer.chunk(choice))
        return "".join(out) or None


def add_chat_routes(app, state: ServeState) -> None:
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"],
                      openapi_extra=request_body(ChatCompletionRequest))
