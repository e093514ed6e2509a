"""The OpenAI-compatible HTTP API over one engine session: /health, /v1/models, /v1/chat/completions,
/v1/completions (with ``echo`` and prompt log-probs), vLLM's /tokenize, /detokenize and /tokenizer_info, /version
and Prometheus /metrics, with server-sent-event streaming, log-probs, tool calls and OpenAI-style errors (unknown
routes and methods included)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from areno.config import SamplingParams
from areno.engine.async_engine import AsyncEngine
from areno.engine.tool_calls import parse_tool_calls
from areno.serve.bodies import parse, request_body
from areno.serve.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    PromptEncoder,
    RequestBodyLimit,
    context_exceeded,
    release_memory,
)
from areno.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from areno.serve.metrics import ServeMetrics
from areno.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from areno.serve.sampling import request_sampling_params
from areno.serve.scoring import prompt_logprobs, score_groups, vllm_prompt_logprobs
from areno.serve.text import Detokenizer, token_offsets
from areno.serve.tokenizer_api import add_tokenizer_routes, render_chat

__all__ = ["Detokenizer", "create_app", "request_body"]
_parse = parse  # the name callers of this module used

log = logging.getLogger("areno.serve")
json_str = json.encoder.encode_basestring  # a str as a JSON string (C), as json.dumps(ensure_ascii=False) writes it
PREP_THREADS = max(2, min(4, os.cpu_count() or 1))  # request parsing and tokenisation, off the event loop
# routes that need the API key when --api-key is set (besides everything under /v1)
PROTECTED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


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
                response = _error(APIError(401, "invalid or missing API key", type="authentication_error",
                                           code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Notes:
    """Accepted request fields that change nothing here but would elsewhere: logged once per field."""

    def __init__(self):
        self.seen: set[str] = set()

    def __call__(self, field: str, why: str) -> None:
        if field not in self.seen:
            self.seen.add(field)
            log.info("request field %s accepted and ignored: %s (logged once)", field, why)


def create_app(engine: AsyncEngine, tokenizer, *, model_name: str, max_model_len: int, api_key: str | None = None,
               max_running: int = 256, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, media=None) -> FastAPI:
    """``media``: a ``ChatMedia`` for chat messages with image/audio/video parts (without one they get a 400)."""
    # parsing, chat-template rendering and tokenisation: a few threads, so a large body never stalls the event loop
    prep_pool = ThreadPoolExecutor(max_workers=PREP_THREADS, thread_name_prefix="areno-prep")
    encode = PromptEncoder(tokenizer, max_model_len)
    vocab = len(tokenizer)
    metrics = ServeMetrics(model_name)
    note = _Notes()
    template = getattr(tokenizer, "chat_template", None)
    template_text = template if isinstance(template, str) else json.dumps(template)

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
    app.state.engine, app.state.prompt_encoder, app.state.metrics = engine, encode, metrics
    app.add_middleware(RequestBodyLimit, limit=max_request_bytes, on_large=after_large_request)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):  # unknown routes, wrong methods: OpenAI-shaped
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message, code = f"Invalid URL ({where}): no such route", "not_found"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
            message = f"Method not allowed ({where})" + (f"; this route allows {allowed}" if allowed else "")
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        body = APIError(exc.status_code, message, code=code).body()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        return _error(APIError(400, f"{param}: {err.get('msg', 'invalid request')}", param=param))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):  # never a bare 500 page; still an OpenAI-shaped body
        return JSONResponse(APIError(500, f"internal error: {exc}", type="server_error").body(), status_code=500)

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    # ---- information -----------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        body = {"status": "ok", "active_requests": engine.num_active}
        if hasattr(engine, "health"):  # the data-parallel front end adds per-replica counters
            body.update(engine.health())
        return body

    @app.get("/version")
    async def version():
        from areno import __version__

        return {"version": __version__}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "areno", "root": model_name,
                "parent": None, "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def metrics_route():
        return Response(await metrics.render(engine), media_type=METRICS_CONTENT_TYPE)

    def check_model(name: str):
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")

    add_tokenizer_routes(app, tokenizer, prep=prep, check_model=check_model, max_model_len=max_model_len,
                         media=media)

    # ---- shared by both generation routes --------------------------------------------------------------------
    def check_request(req):
        """What a request's fields mean beyond their schema: token ids inside the vocabulary, notes on fields
        accepted and ignored."""
        if req.stop_token_ids and any(t >= vocab for t in req.stop_token_ids):
            raise APIError(400, f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
        if req.logit_bias and max(map(int, req.logit_bias)) >= vocab:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        if req.store:
            note("store", "this server does not store completions")
        if req.metadata:
            note("metadata", "kept only by servers that store completions")
        if req.service_tier not in (None, "auto", "default"):
            note("service_tier", "this server has one tier")
        effort = getattr(req, "reasoning_effort", None)
        if effort is not None and "reasoning_effort" not in template_text:
            note("reasoning_effort", "passed to the chat template, which does not use it")

    def options(req, prompt_len: int, max_tokens: int | None, top_logprobs: int) -> SamplingParams:
        if prompt_len >= max_model_len:
            raise context_exceeded(f"{prompt_len} tokens", max_model_len,
                                   "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        room = max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"{name} ({max_tokens}) + prompt ({prompt_len} tokens) exceeds the context "
                           f"({max_model_len})", param=name, code="context_length_exceeded")
        if req.n > max_running:
            raise APIError(400, f"n ({req.n}) exceeds --max-running-prompts ({max_running})", param="n")
        return request_sampling_params(req, max_new_tokens=max_tokens or room, top_logprobs=top_logprobs)

    async def run(prompt_ids, opts, arrival: float, mm=None):
        try:
            stream = await (engine.submit(prompt_ids, opts) if mm is None else engine.submit(prompt_ids, opts, mm=mm))
        except APIError:
            raise
        except Exception as exc:
            raise APIError(400, str(exc)) from exc
        return metrics.track(stream, len(prompt_ids), arrival)

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

    def tok(i: int) -> str:
        return tokenizer.decode([i])

    def token_str(req):
        """How log-probs name a token: its text, or ``token_id:<id>`` (vLLM's return_tokens_as_token_ids)."""
        return (lambda i: f"token_id:{i}") if req.return_tokens_as_token_ids else tok

    def detokenizer(req) -> Detokenizer:
        return Detokenizer(tokenizer, req.stop_list(), skip_special_tokens=req.skip_special_tokens,
                           include_stop=req.include_stop_str_in_output)

    def chat_logprobs(o, k: int, name):
        content = []
        for i, lp, top in zip(o["ids"], o["logprobs"], o["top"]):
            s = name(i)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": name(t), "logprob": v, "bytes": list(name(t).encode())}
                                             for t, v in (top or [])[:k]]})
        return {"content": content}

    def top_dict(pairs, name) -> dict:
        """Top candidates as {token: log-prob}, most likely first; two ids with the same text keep the likelier."""
        out = {}
        for t, v in pairs or []:
            out.setdefault(name(t), v)
        return out

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def continuous_usage(req) -> bool:
        so = req.stream_options
        return bool(so and so.include_usage and so.continuous_usage_stats)

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def chunk_prefix(rid: str, kind: str, created: int) -> str:
        """The constant start of a stream's chunks, up to the choice's index: the common chunk (text only) is then
        a few string joins (the per-token path: no dict, no json.dumps of the whole body)."""
        return (f'data: {{"id":{json_str(rid)},"object":"{kind}","created":{created},"model":{json_str(model_name)},'
                f'"choices":[{{"index":')

    # ---- chat ----------------------------------------------------------------------------------------------
    def prepare_chat(raw: bytes):
        """Body -> (request, prompt ids, sampling options, top log-probs, images or None): on the prep pool."""
        req = parse(raw, ChatCompletionRequest)
        check_model(req.model)
        check_request(req)
        mm = None
        if req.has_media():  # image parts: the model's processor (expanded placeholders, pixel rows)
            if media is None:
                raise APIError(400, "this server takes no image, audio or video parts", param="messages")
            if req.prompt_logprobs is not None:
                raise APIError(400, "prompt_logprobs is not supported yet for prompts with images",
                               param="prompt_logprobs")
            mm = media.encode(req)
            prompt_ids = mm.input_ids
        else:
            prompt_ids = encode(render_chat(tokenizer, req), "messages")
        k = (req.top_logprobs or 0) if req.logprobs else 0
        return req, prompt_ids, options(req, len(prompt_ids), req.token_limit(), k), k, mm

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat(request: Request):
        arrival = time.perf_counter()
        req, prompt_ids, opts, k, mm = await prep(prepare_chat, await request.body())
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        stream = await run(prompt_ids, opts, arrival, mm)
        plp = None
        if req.prompt_logprobs is not None:  # vLLM's extension (never streamed): a forward while it decodes
            try:
                (score,) = await score_prompts([prompt_ids], req.prompt_logprobs, ranks=True, param="prompt_logprobs")
            except BaseException:
                stream.abort()
                raise
            plp = {"prompt_logprobs": vllm_prompt_logprobs(prompt_ids, score, req.prompt_logprobs, token_str(req))}
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(
                chat_stream(stream, req, rid, created, len(prompt_ids), parse_tools, k),
                media_type="text/event-stream")
        try:
            out = await collect(request, stream)
        finally:
            stream.abort()
        choices = []
        name = token_str(req)
        for idx, o in enumerate(out):
            d = detokenizer(req)
            d.ids = o["ids"]
            text = d.final_text(o["stop_text"], o["finish"])
            message = {"role": "assistant", "content": text}
            finish = o["finish"] or "abort"
            if parse_tools:
                content, calls = parse_tool_calls(text)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [c.to_openai() for c in calls]}
                    finish = "tool_calls"
            choices.append({"index": idx, "message": message, "finish_reason": finish,
                            "logprobs": chat_logprobs(o, k, name) if req.logprobs else None})
        completion_tokens = sum(len(o["ids"]) for o in out)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(len(prompt_ids), completion_tokens), **(plp or {})}

    async def chat_stream(stream, req, rid, created, prompt_len, parse_tools, k):
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}
        detoks = [detokenizer(req) for _ in range(req.n)]
        name = token_str(req)
        completion_tokens = 0
        every = continuous_usage(req)
        prefix = chunk_prefix(rid, "chat.completion.chunk", created)

        def chunk(choice) -> str:
            body = {**head, "choices": [choice]}
            if every:
                body["usage"] = usage(prompt_len, completion_tokens)
            return sse(body)

        try:
            for i in range(req.n):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                             "logprobs": None})
            held = [{"ids": [], "logprobs": [], "top": []} for _ in range(req.n)]  # log-probs not yet sent
            async for first in stream:
                # every event already queued goes out with this one: one chunk per sample however far behind
                by_index: dict[int, list] = {}
                for ev in [first, *stream.pending()]:
                    by_index.setdefault(ev.index, []).append(ev)
                for index, evs in by_index.items():
                    d, h, last = detoks[index], held[index], evs[-1]
                    got = [ev for ev in evs if ev.token_id is not None]
                    ids = [ev.token_id for ev in got]
                    completion_tokens += len(ids)
                    if last.finish_reason is None:
                        delta_text = d.push_many(ids)
                    else:  # the last token's text goes out through flush, once the stop string is known
                        d.ids.extend(ids)
                        delta_text = ""
                    if req.logprobs:
                        h["ids"] += ids
                        h["logprobs"] += [ev.logprob for ev in got]
                        h["top"] += [ev.top for ev in got]
                    if last.finish_reason is None and not (delta_text and not parse_tools):
                        continue  # nothing to show yet (held-back text, or tool calls parsed at the end)
                    lp = chat_logprobs(h, k, name) if req.logprobs and h["ids"] else None
                    held[index] = {"ids": [], "logprobs": [], "top": []}
                    if last.finish_reason is None:
                        if lp is None and not every:  # the hot path: a template, no dict, no json.dumps
                            yield (f'{prefix}{index},"delta":{{"content":{json_str(delta_text)}}},'
                                   f'"finish_reason":null,"logprobs":null}}]}}\n\n')
                        else:
                            yield chunk({"index": index, "delta": {"content": delta_text}, "finish_reason": None,
                                         "logprobs": lp})
                        continue
                    finish = last.finish_reason
                    if parse_tools:
                        content, calls = parse_tool_calls(d.final_text(last.stop_text, finish))
                        delta = {"content": content}
                        if calls:
                            delta["tool_calls"] = [{"index": j, **c.to_openai()} for j, c in enumerate(calls)]
                            finish = "tool_calls"
                    else:
                        delta = {"content": delta_text + d.flush(last.stop_text, finish)}
                    yield chunk({"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp})
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
        """Body -> (request, each prompt's ids, each one's echoed text, each one's sampling options (None: nothing
        to generate), top log-probs): on the prep pool."""
        req = parse(raw, CompletionRequest)
        check_model(req.model)
        check_request(req)
        p = req.prompt
        if isinstance(p, str):
            texts, prompts = [p], [encode(p, "prompt")]
        elif all(isinstance(x, int) for x in p):
            texts, prompts = [None], [list(p)]
        elif all(isinstance(x, str) for x in p):
            texts, prompts = list(p), [encode(x, "prompt") for x in p]
        else:
            texts, prompts = [None] * len(p), [list(x) for x in p]
        for ids in prompts:
            if not ids:
                raise APIError(400, "a prompt encodes to no tokens", param="prompt")
            if len(ids) >= max_model_len:  # before looking at every id of a huge list
                raise context_exceeded(f"{len(ids)} tokens", max_model_len, "prompt")
            if any(t < 0 or t >= vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        k = req.logprobs or 0
        limit = req.token_limit()
        limit = 16 if limit is None else limit
        opts = [options(req, len(ids), limit, k) if limit > 0 else None for ids in prompts]
        echo = None
        if req.echo:  # each prompt's text (as sent, or decoded) and, with log-probs, its tokens and their offsets
            echo = []
            for text, ids in zip(texts, prompts):
                if text is None:
                    text = tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
                    offsets = token_offsets(tokenizer, ids, skip_special_tokens=req.skip_special_tokens)
                elif req.logprobs is not None:  # the text as sent spells special tokens out
                    offsets = token_offsets(tokenizer, ids, skip_special_tokens=False)
                else:
                    offsets = []
                echo.append({"text": text, "offsets": [min(x, len(text)) for x in offsets]})
        return req, prompts, echo, opts, k

    async def score_prompts(prompts: list[list[int]], k: int, ranks: bool = False, param: str = "echo"):
        """Each prompt's (token log-probs from its second token on, top-k per position, ranks) from the engine's
        model."""
        run_on_engine = getattr(engine, "run_on_engine", None)
        if run_on_engine is None:
            raise APIError(400, "prompt log-probs are not supported yet by this engine", param=param)
        scores = [None] * len(prompts)
        for group in score_groups(prompts):
            try:
                got = await run_on_engine(prompt_logprobs, [prompts[i] for i in group], k, ranks)
            except ValueError as exc:
                raise APIError(400, str(exc), param=param) from exc
            for i, s in zip(group, got):
                scores[i] = s
        return scores

    def prompt_logprob_part(req, ids, echo, score, k) -> dict:
        """The echoed prompt's share of a choice's log-probs: the first token has no log-prob (nothing before it)."""
        name = token_str(req)
        lps, tops = score[:2]
        return {"tokens": [name(i) for i in ids], "token_logprobs": [None, *lps],
                "top_logprobs": [None, *(top_dict(t[:k], name) for t in tops)] if k else None,
                "text_offset": list(echo["offsets"])}

    def completion_logprob_part(req, ids, lps, tops, offsets, k, shift: int) -> dict:
        name = token_str(req)
        return {"tokens": [name(i) for i in ids], "token_logprobs": list(lps),
                "top_logprobs": [top_dict(t, name) for t in tops] if k else None,
                "text_offset": [x + shift for x in offsets]}

    def joined(a: dict | None, b: dict) -> dict:
        if a is None:
            return b
        top = None if a["top_logprobs"] is None else a["top_logprobs"] + b["top_logprobs"]
        return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
                "top_logprobs": top, "text_offset": a["text_offset"] + b["text_offset"]}

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest, vocab=vocab))
    async def completions(request: Request):
        arrival = time.perf_counter()
        req, prompts, echo, opts, k = await prep(prepare_completions, await request.body())
        streams = []
        try:
            for ids, o in zip(prompts, opts):
                if o is not None:
                    streams.append(await run(ids, o, arrival))
            # the prompts' log-probs (echoed, and/or vLLM's prompt_logprobs): a forward on the engine thread,
            # while the completions decode
            echo_scored, pk = bool(echo) and req.logprobs is not None, req.prompt_logprobs
            scores = None
            if echo_scored or pk is not None:
                scores = await score_prompts(prompts, max(k if echo_scored else 0, pk or 0), ranks=pk is not None,
                                             param="echo" if echo_scored else "prompt_logprobs")
        except BaseException:
            for s in streams:
                s.abort()
            raise
        echo_lp = None
        if echo_scored:
            echo_lp = [prompt_logprob_part(req, ids, e, s, k) for ids, e, s in zip(prompts, echo, scores)]
        plp = None
        if pk is not None:
            plp = [vllm_prompt_logprobs(ids, s, pk, token_str(req)) for ids, s in zip(prompts, scores)]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(x) for x in prompts)
        if req.stream:
            return StreamingResponse(completion_stream(streams, req, rid, created, prompt_tokens, len(prompts),
                                                       echo, echo_lp, k), media_type="text/event-stream")
        try:
            outs = await asyncio.gather(*(collect(request, s) for s in streams))
        finally:
            for s in streams:
                s.abort()
        if not streams:  # max_tokens 0: the prompts only
            outs = [[{"ids": [], "logprobs": [], "top": [], "finish": "length", "stop_text": None}] * req.n
                    for _ in prompts]
        choices = []
        for pi, out in enumerate(outs):
            prefix = echo[pi]["text"] if echo else ""
            for si, o in enumerate(out):
                d = detokenizer(req)
                d.ids = o["ids"]
                text = d.final_text(o["stop_text"], o["finish"])
                lp = None
                if req.logprobs is not None:
                    offsets = token_offsets(tokenizer, o["ids"], skip_special_tokens=req.skip_special_tokens)
                    lp = completion_logprob_part(req, o["ids"], o["logprobs"], o["top"],
                                                 [min(x, len(text)) for x in offsets], k, len(prefix))
                    lp = joined(echo_lp[pi] if echo_lp else None, lp)
                choices.append({"index": pi * req.n + si, "text": prefix + text, "logprobs": lp,
                                "finish_reason": o["finish"] or "abort",
                                **({"prompt_logprobs": plp[pi]} if plp is not None else {})})
        completion_tokens = sum(len(o["ids"]) for out in outs for o in out)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    async def completion_stream(streams, req, rid, created, prompt_tokens, num_prompts, echo, echo_lp, k):
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        completion_tokens = 0
        every = continuous_usage(req)
        prefix = chunk_prefix(rid, "text_completion", created)

        def chunk(choice) -> str:
            body = {**head, "choices": [choice]}
            if every:
                body["usage"] = usage(prompt_tokens, completion_tokens)
            return sse(body)

        merged: asyncio.Queue = asyncio.Queue()

        async def pump(pi, stream):
            try:
                async for ev in stream:
                    merged.put_nowait([(pi, ev), *((pi, e) for e in stream.pending())])
            except Exception as exc:
                merged.put_nowait([(pi, exc)])
            merged.put_nowait([(pi, None)])

        async def batches():
            """Lists of (prompt index, event or exception): everything queued at the time. One prompt: read its
            stream directly; several: their pumps' batches, merged."""
            if len(streams) == 1:
                stream = streams[0]
                try:
                    async for ev in stream:
                        yield [(0, ev), *((0, e) for e in stream.pending())]
                except Exception as exc:
                    yield [(0, exc)]
                return
            live = len(streams)
            while live:
                batch = await merged.get()
                while not merged.empty():
                    batch += merged.get_nowait()
                live -= sum(ev is None for _, ev in batch)
                yield [(pi, ev) for pi, ev in batch if ev is not None]

        tasks = [asyncio.create_task(pump(pi, s)) for pi, s in enumerate(streams)] if len(streams) > 1 else []
        detoks: dict[tuple[int, int], Detokenizer] = {}
        held: dict[tuple[int, int], dict] = {}  # log-probs of tokens whose text is not sent yet
        try:
            if echo:  # the prompt first, as its own chunk per choice
                for pi in range(num_prompts):
                    for si in range(req.n):
                        yield chunk({"index": pi * req.n + si, "text": echo[pi]["text"],
                                     "logprobs": echo_lp[pi] if echo_lp else None,
                                     "finish_reason": None if streams else "length"})
            async for batch in batches():
                by_key: dict[tuple[int, int], list] = {}  # (prompt, sample) -> its events in this batch
                for pi, ev in batch:
                    if isinstance(ev, Exception):
                        yield sse(APIError(400, str(ev)).body())
                        continue
                    by_key.setdefault((pi, ev.index), []).append(ev)
                for key, evs in by_key.items():
                    d = detoks.get(key)
                    if d is None:
                        d = detoks[key] = detokenizer(req)
                    last = evs[-1]
                    finish = last.finish_reason
                    if req.logprobs is None:
                        ids = [ev.token_id for ev in evs if ev.token_id is not None]
                        completion_tokens += len(ids)
                        if finish is None:
                            text = d.push_many(ids)
                        else:  # the last token's text goes out through flush, once the stop string is known
                            d.ids.extend(ids)
                            text = d.flush(last.stop_text, finish)
                        if not text and finish is None:
                            continue  # held back (an incomplete character, what may start a stop string)
                        index = key[0] * req.n + key[1]
                        if every:
                            yield chunk({"index": index, "text": text, "logprobs": None, "finish_reason": finish})
                        else:  # the hot path: a template, no dict, no json.dumps
                            yield (f'{prefix}{index},"text":{json_str(text)},"logprobs":null,"finish_reason":'
                                   f'{"null" if finish is None else json_str(finish)}}}]}}\n\n')
                        continue
                    h = held.get(key)
                    if h is None:
                        h = held[key] = {"ids": [], "lps": [], "tops": [], "offsets": []}
                    text = ""
                    for ev in evs:  # per token: each one's offset in the text
                        if ev.token_id is not None:
                            completion_tokens += 1
                            h["offsets"].append(d.offset)
                            text += d.push(ev.token_id, emit=ev.finish_reason is None)
                            h["ids"].append(ev.token_id)
                            h["lps"].append(ev.logprob)
                            h["tops"].append(ev.top)
                    if finish is not None:
                        text += d.flush(last.stop_text, finish)
                    if not (text or finish is not None):
                        continue  # held back: its log-probs go with the next chunk that carries text
                    sent = d.sent  # offsets index into the text sent so far
                    shift = len(echo[key[0]]["text"]) if echo else 0
                    lp = completion_logprob_part(req, h["ids"], h["lps"], h["tops"],
                                                 [min(x, sent) for x in h["offsets"]], k, shift)
                    held[key] = {"ids": [], "lps": [], "tops": [], "offsets": []}
                    yield chunk({"index": key[0] * req.n + key[1], "text": text, "logprobs": lp,
                                 "finish_reason": finish})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"
        finally:
            for s in streams:
                s.abort()
            for t in tasks:
                t.cancel()

    return app
