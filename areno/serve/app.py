"""The OpenAI-compatible HTTP API over one engine session: /health, /v1/models, /v1/chat/completions,
/v1/completions, with server-sent-event streaming, log-probs, tool calls and OpenAI-style 4xx errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from areno.rollout.async_engine import AsyncEngine
from areno.rollout.sequence import SamplingOptions
from areno.rollout.tool_calls import parse_tool_calls
from areno.serve.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    PromptEncoder,
    RequestBodyLimit,
    context_exceeded,
    release_memory,
)
from areno.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest

PREP_THREADS = max(2, min(4, os.cpu_count() or 1))  # request parsing and tokenisation, off the event loop
# a JSON escape of a UTF-16 surrogate (\ud800-\udfff): the only way a valid UTF-8 body can yield a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class Detokenizer:
    """Incremental text of one choice: holds back an incomplete UTF-8 tail and what may start a stop string.

    Decodes only a short window of recent tokens per step (``prefix``..end minus ``prefix``..``read``), so a long
    completion costs O(length), not O(length^2); the final text is one full decode.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.acc = ""  # text decoded so far (up to ``read``)
        self.prefix = self.read = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self) -> str:
        return self._decode(self.ids)

    def final_text(self, stop_text: str | None) -> str:
        text = self.text()
        if stop_text:
            i = text.find(stop_text)
            if i >= 0:
                text = text[:i]
        return text

    def push(self, token_id: int, emit: bool = True) -> str:
        """Add a token; return the text now safe to send (nothing when ``emit`` is False: the last token, whose
        text goes out through :meth:`flush` once the stop string is known)."""
        self.ids.append(token_id)
        if not emit:
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):  # a complete character more
            self.acc += now[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        end = len(self.acc) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = self.acc[self.sent : end], end
        return delta

    def flush(self, stop_text: str | None) -> str:
        text = self.final_text(stop_text)
        delta = text[self.sent :]
        self.sent = len(text)
        return delta


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _parse(raw: bytes, model_cls):
    """A request body as ``model_cls``, or an APIError saying what is wrong with it. CPU work proportional to the
    body: runs on the prep pool, never on the event loop."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, "the request body is not valid UTF-8") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON in the request body: {exc}") from exc
    except RecursionError as exc:
        raise APIError(400, "the request body is nested too deeply") from exc
    del text
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:  # a \ud800-style escape decodes to a lone surrogate: not text the tokenizer (or UTF-8) can hold
        if _SURROGATE_ESCAPE.search(raw):
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, "the request body holds a lone UTF-16 surrogate escape (not valid Unicode text)") from exc
    except RecursionError as exc:
        raise APIError(400, "the request body is nested too deeply") from exc
    try:
        return model_cls.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        msg = err.get("msg", "invalid request")
        if err.get("type") == "extra_forbidden":
            msg = f"unsupported field: {param} (this server does not implement it)"
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from exc


def _inline_refs(node, defs):
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def _bound_token_ids(node, vocab: int):
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = vocab - 1
        for v in node.values():
            _bound_token_ids(v, vocab)
    elif isinstance(node, list):
        for v in node:
            _bound_token_ids(v, vocab)


def request_body(model_cls, vocab: int | None = None) -> dict:
    """``openapi_extra`` describing a route's JSON body by its pydantic model (the routes parse bodies themselves, to
    answer malformed ones with OpenAI-style errors, so FastAPI cannot infer it). References are inlined: the
    models are not recursive, and the schema then stands alone under the route. ``vocab`` bounds the token ids
    of a completion prompt."""
    schema = model_cls.model_json_schema()
    if vocab is not None and "prompt" in schema["properties"]:
        _bound_token_ids(schema["properties"]["prompt"], vocab)
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": _inline_refs(schema, schema.get("$defs", {}))}}}}


class BearerAuth:
    """``Authorization: Bearer <key>`` on ``/v1`` routes, as plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` would pipe every streamed chunk through an extra task and memory stream (a third of the
    event loop's time per token under load)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if header != self.expected:
                response = _error(APIError(401, "invalid or missing API key", type="authentication_error",
                                           code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: AsyncEngine, tokenizer, *, model_name: str, max_model_len: int, api_key: str | None = None,
               max_running: int = 256, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    # parsing, chat-template rendering and tokenisation: a few threads, so a large body never stalls the event loop
    prep_pool = ThreadPoolExecutor(max_workers=PREP_THREADS, thread_name_prefix="areno-prep")
    encode = PromptEncoder(tokenizer, max_model_len)
    vocab = len(tokenizer)

    async def prep(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(prep_pool, fn, *args)

    async def after_large_request(size: int):
        try:
            await prep(release_memory)
        except RuntimeError:  # the pool is shut down: the server is stopping anyway
            pass

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # after uvicorn has drained (or given up on) the connections: abort what is left, stop the engine thread
        await asyncio.to_thread(engine.shutdown, drain=False)
        prep_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="areno", version="1", lifespan=lifespan)
    app.state.engine, app.state.prompt_encoder = engine, encode
    app.add_middleware(RequestBodyLimit, limit=max_request_bytes, on_large=after_large_request)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):  # never a bare 500 page; still an OpenAI-shaped body
        return JSONResponse(APIError(500, f"internal error: {exc}", type="server_error").body(), status_code=500)

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        body = {"status": "ok", "active_requests": engine.num_active}
        if hasattr(engine, "health"):  # the data-parallel front end adds per-replica counters
            body.update(engine.health())
        return body

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "areno",
                                            "max_model_len": max_model_len}]}

    def check_model(name: str):
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")

    def options(req, prompt_len: int, max_tokens: int | None, top_logprobs: int) -> SamplingOptions:
        if prompt_len >= max_model_len:
            raise context_exceeded(f"{prompt_len} tokens", max_model_len,
                                   "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        room = max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens ({max_tokens}) + prompt ({prompt_len} tokens) exceeds the context "
                           f"({max_model_len})", param="max_tokens", code="context_length_exceeded")
        if req.n > max_running:
            raise APIError(400, f"n ({req.n}) exceeds --max-running-prompts ({max_running})", param="n")
        temperature = 1.0 if req.temperature is None else req.temperature
        # any k beyond the vocabulary means no cut; bounded so it fits the sampler's int64 (an engine-step error
        # would fail every request in the batch, not just this one)
        top_k = min(req.top_k, 1 << 30) if req.top_k and req.top_k > 0 else 0
        return SamplingOptions(
            temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
            max_new_tokens=max_tokens or room, min_new_tokens=min(req.min_tokens, max_tokens or room),
            stop=req.stop_list(), ignore_eos=req.ignore_eos, seed=req.seed, n=req.n, top_logprobs=top_logprobs,
        )

    async def run(request: Request, prompt_ids, opts):
        try:
            stream = await engine.submit(prompt_ids, opts)
        except APIError:
            raise
        except Exception as exc:
            raise APIError(400, str(exc)) from exc
        return stream

    async def collect(request: Request, stream):
        """Gather a request's events per sample, aborting it if the client disconnects meanwhile."""
        out = [{"ids": [], "logprobs": [], "top": [], "finish": None, "stop_text": None}
               for _ in range(stream.options.n)]
        it = stream.__aiter__()
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            while not nxt.done():
                done, _ = await asyncio.wait({nxt}, timeout=0.25)
                if not done and await request.is_disconnected():
                    stream.abort()
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                return out
            except ValueError as exc:
                raise APIError(400, str(exc)) from exc
            o = out[ev.index]
            if ev.token_id is not None:
                o["ids"].append(ev.token_id)
                o["logprobs"].append(ev.logprob)
                o["top"].append(ev.top)
            if ev.finish_reason is not None:
                o["finish"], o["stop_text"] = ev.finish_reason, ev.stop_text

    def tool_arguments(args):
        """An assistant tool call's arguments for the chat template: a JSON-object string becomes the object."""
        if not isinstance(args, str) or not args.strip().startswith("{"):
            return args
        try:
            return json.loads(args)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise APIError(400, f"a tool call's arguments are not valid JSON: {exc}",
                           param="messages.tool_calls.function.arguments") from exc

    def tok(i: int) -> str:
        return tokenizer.decode([i])

    def chat_logprobs(o, k: int):
        content = []
        for i, lp, top in zip(o["ids"], o["logprobs"], o["top"]):
            s = tok(i)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": tok(t), "logprob": v, "bytes": list(tok(t).encode())}
                                             for t, v in (top or [])[:k]]})
        return {"content": content}

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    # ---- chat ----------------------------------------------------------------------------------------------
    def prepare_chat(raw: bytes):
        """Body -> (request, prompt ids, sampling options, top log-probs): on the prep pool."""
        req = _parse(raw, ChatCompletionRequest)
        check_model(req.model)
        messages = []
        for m in req.messages:
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text() or ""}
            if m.tool_calls:
                msg["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                    "name": c.function.name, "arguments": tool_arguments(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.name:
                msg["name"] = m.name
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:
            raise APIError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages") from exc
        prompt_ids = encode(text, "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        k = (req.top_logprobs or 0) if req.logprobs else 0
        return req, prompt_ids, options(req, len(prompt_ids), max_tokens, k), k

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat(request: Request):
        req, prompt_ids, opts, k = await prep(prepare_chat, await request.body())
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        stream = await run(request, prompt_ids, opts)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(
                chat_stream(request, stream, req, rid, created, len(prompt_ids), parse_tools, k),
                media_type="text/event-stream")
        out = await collect(request, stream)
        choices = []
        for idx, o in enumerate(out):
            d = Detokenizer(tokenizer, opts.stop)
            d.ids = o["ids"]
            text = d.final_text(o["stop_text"])
            message = {"role": "assistant", "content": text}
            finish = o["finish"] or "abort"
            if parse_tools:
                content, calls = parse_tool_calls(text)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [c.to_openai() for c in calls]}
                    finish = "tool_calls"
            choices.append({"index": idx, "message": message, "finish_reason": finish,
                            "logprobs": chat_logprobs(o, k) if req.logprobs else None})
        completion_tokens = sum(len(o["ids"]) for o in out)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(len(prompt_ids), completion_tokens)}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def chat_stream(request, stream, req, rid, created, prompt_len, parse_tools, k):
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}
        detoks = [Detokenizer(tokenizer, req.stop_list()) for _ in range(req.n)]
        completion_tokens = 0
        try:
            for i in range(req.n):
                yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": None}]})
            held = [{"ids": [], "logprobs": [], "top": []} for _ in range(req.n)]  # log-probs not yet sent
            async for first in stream:
                # every event already queued goes out with this one: one chunk per sample however far behind
                by_index: dict[int, list] = {}
                for ev in [first, *stream.pending()]:
                    by_index.setdefault(ev.index, []).append(ev)
                for index, evs in by_index.items():
                    d, h, last = detoks[index], held[index], evs[-1]
                    delta_text = ""
                    for ev in evs:
                        if ev.token_id is not None:
                            completion_tokens += 1
                            delta_text += d.push(ev.token_id, emit=ev.finish_reason is None)
                            h["ids"].append(ev.token_id)
                            h["logprobs"].append(ev.logprob)
                            h["top"].append(ev.top)
                    if last.finish_reason is None and not (delta_text and not parse_tools):
                        continue  # nothing to show yet (held-back text, or tool calls parsed at the end)
                    lp = chat_logprobs(h, k) if req.logprobs and h["ids"] else None
                    held[index] = {"ids": [], "logprobs": [], "top": []}
                    if last.finish_reason is None:
                        yield sse({**head, "choices": [{"index": index, "delta": {"content": delta_text},
                                                        "finish_reason": None, "logprobs": lp}]})
                        continue
                    finish = last.finish_reason
                    if parse_tools:
                        content, calls = parse_tool_calls(d.final_text(last.stop_text))
                        delta = {"content": content}
                        if calls:
                            delta["tool_calls"] = [{"index": j, **c.to_openai()} for j, c in enumerate(calls)]
                            finish = "tool_calls"
                    else:
                        delta = {"content": delta_text + d.flush(last.stop_text)}
                    yield sse({**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                                    "logprobs": lp}]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_len, completion_tokens)})
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            stream.abort()
            raise
        except Exception as exc:
            stream.abort()
            yield sse(APIError(400, str(exc)).body())
        finally:
            stream.abort()

    # ---- completions ---------------------------------------------------------------------------------------
    def prepare_completions(raw: bytes):
        """Body -> (request, each prompt's ids, each one's sampling options, log-probs): on the prep pool."""
        req = _parse(raw, CompletionRequest)
        check_model(req.model)
        p = req.prompt
        if isinstance(p, str):
            prompts = [encode(p, "prompt")]
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif all(isinstance(x, str) for x in p):
            prompts = [encode(x, "prompt") for x in p]
        else:
            prompts = [list(x) for x in p]
        for ids in prompts:
            if not ids:
                raise APIError(400, "a prompt encodes to no tokens", param="prompt")
            if len(ids) >= max_model_len:  # before looking at every id of a huge list
                raise context_exceeded(f"{len(ids)} tokens", max_model_len, "prompt")
            if any(t < 0 or t >= vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        k = req.logprobs or 0
        return req, prompts, [options(req, len(ids), req.max_tokens or 16, k) for ids in prompts], k

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest, vocab))
    async def completions(request: Request):
        req, prompts, opts, k = await prep(prepare_completions, await request.body())
        streams = [await run(request, ids, o) for ids, o in zip(prompts, opts)]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(x) for x in prompts)
        if req.stream:
            return StreamingResponse(completion_stream(streams, req, rid, created, prompt_tokens),
                                     media_type="text/event-stream")
        try:
            outs = await asyncio.gather(*(collect(request, s) for s in streams))
        finally:
            for s in streams:
                s.abort()
        choices = []
        for pi, out in enumerate(outs):
            for si, o in enumerate(out):
                d = Detokenizer(tokenizer, req.stop_list())
                d.ids = o["ids"]
                text = d.final_text(o["stop_text"])
                lp = None
                if req.logprobs is not None:
                    toks = [tok(i) for i in o["ids"]]
                    offsets, pos = [], 0
                    for s in toks:
                        offsets.append(pos)
                        pos += len(s)
                    lp = {"tokens": toks, "token_logprobs": o["logprobs"], "text_offset": offsets,
                          "top_logprobs": [{tok(t): v for t, v in (top or [])} for top in o["top"]] if k else None}
                choices.append({"index": pi * req.n + si, "text": text, "logprobs": lp,
                                "finish_reason": o["finish"] or "abort"})
        completion_tokens = sum(len(o["ids"]) for out in outs for o in out)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    async def completion_stream(streams, req, rid, created, prompt_tokens):
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        merged: asyncio.Queue = asyncio.Queue()
        completion_tokens = 0

        async def pump(pi, stream):
            try:
                async for ev in stream:
                    await merged.put((pi, ev))
            except Exception as exc:
                await merged.put((pi, exc))
            await merged.put((pi, None))

        tasks = [asyncio.create_task(pump(pi, s)) for pi, s in enumerate(streams)]
        detoks = {}
        try:
            live = len(streams)
            while live:
                batch = [await merged.get()]
                while not merged.empty():  # a consumer that fell behind sends what is queued as one chunk each
                    batch.append(merged.get_nowait())
                texts: dict[tuple[int, int], list] = {}  # (prompt, sample) -> [text, finish_reason]
                for pi, ev in batch:
                    if ev is None:
                        live -= 1
                        continue
                    if isinstance(ev, Exception):
                        yield sse(APIError(400, str(ev)).body())
                        continue
                    d = detoks.setdefault((pi, ev.index), Detokenizer(tokenizer, req.stop_list()))
                    entry = texts.setdefault((pi, ev.index), ["", None])
                    if ev.token_id is not None:
                        completion_tokens += 1
                        entry[0] += d.push(ev.token_id, emit=ev.finish_reason is None)
                    if ev.finish_reason is not None:
                        entry[0] += d.flush(ev.stop_text)
                        entry[1] = ev.finish_reason
                for (pi, index), (text, finish) in texts.items():
                    if text or finish is not None:
                        yield sse({**head, "choices": [{"index": pi * req.n + index, "text": text, "logprobs": None,
                                                        "finish_reason": finish}]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"
        finally:
            for s in streams:
                s.abort()
            for t in tasks:
                t.cancel()

    return app
