"""``POST /v1/completions``: one or several prompts (text or token ids) completed ``n`` times each, answered whole or
streamed as ``text_completion`` events, with log-probs, ``echo`` (the prompt, with its own log-probs: what
lm-evaluation-harness's loglikelihood tasks send) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from areno.serve.bodies import json_body, request_body
from areno.serve.chunks import ChunkWriter, EventBatches, json_str, usage
from areno.serve.errors import APIError
from areno.serve.generation import check_request, collect, empty_sample, sampling_options, score_prompts, submit
from areno.serve.limits import context_exceeded
from areno.serve.logprobs import completion_part, joined, prompt_part
from areno.serve.protocol import CompletionRequest, parse
from areno.serve.scoring import vllm_prompt_logprobs
from areno.serve.state import ServeState
from areno.serve.text import token_offsets


def prompt_ids(state: ServeState, req) -> tuple[list, list[list[int]]]:
    """Each prompt's text as sent (None for token ids) and its token ids, checked against the context and the
    vocabulary."""
    p, encode, vocab = req.prompt, state.prompt_encoder, state.vocab
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
        if len(ids) >= state.max_model_len:  # before looking at every id of a huge list
            raise context_exceeded(f"{len(ids)} tokens", state.max_model_len, "prompt")
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return texts, prompts


def echoed(tokenizer, req, texts: list, prompts: list[list[int]]) -> list[dict]:
    """Each prompt's text (as sent, or decoded) and, with log-probs, its tokens' offsets in that text."""
    echo = []
    skip = req.skip_special_tokens
    for text, ids in zip(texts, prompts):
        if text is None:
            text = tokenizer.decode(ids, skip_special_tokens=skip)
            offsets = token_offsets(tokenizer, ids, skip_special_tokens=skip)
        elif req.logprobs is not None:  # the text as sent spells special tokens out
            offsets = token_offsets(tokenizer, ids, skip_special_tokens=False)
        else:
            offsets = []
        echo.append({"text": text, "offsets": [min(x, len(text)) for x in offsets]})
    return echo


def prepare_completions(state: ServeState, raw: bytes):
    """Body -> (request, each prompt's ids, each one's echoed text, each one's sampling options (None: nothing to
    generate), top log-probs): on the prep pool."""
    req = parse(raw, CompletionRequest)
    state.check_model(req.model)
    check_request(state, req)
    texts, prompts = prompt_ids(state, req)
    k = req.logprobs or 0
    limit = req.token_limit()
    limit = 16 if limit is None else limit
    opts = [sampling_options(state, req, len(ids), limit, k) if limit > 0 else None for ids in prompts]
    echo = echoed(state.tokenizer, req, texts, prompts) if req.echo else None
    return req, prompts, echo, opts, k


async def start(state: ServeState, req, prompts, echo, opts, k: int, arrival: float):
    """The prompts on the engine, and (echoed with log-probs, or vLLM's prompt_logprobs) their scores from a
    forward on the engine thread while the completions decode: (streams, echo log-probs, prompt_logprobs)."""
    streams = []
    try:
        for ids, o in zip(prompts, opts):
            if o is not None:
                streams.append(await submit(state, ids, o, arrival))
        echo_scored, pk = bool(echo) and req.logprobs is not None, req.prompt_logprobs
        scores = None
        if echo_scored or pk is not None:
            scores = await score_prompts(state, prompts, max(k if echo_scored else 0, pk or 0),
                                         ranks=pk is not None, param="echo" if echo_scored else "prompt_logprobs")
    except BaseException:
        for s in streams:
            s.abort()
        raise
    name = state.token_namer(req)
    echo_lp = [prompt_part(name, ids, e, s, k) for ids, e, s in zip(prompts, echo, scores)] if echo_scored else None
    plp = [vllm_prompt_logprobs(ids, s, pk, name) for ids, s in zip(prompts, scores)] if pk is not None else None
    return streams, echo_lp, plp


async def completions(request: Request):
    state: ServeState = request.app.state.serve
    arrival = time.perf_counter()
    req, prompts, echo, opts, k = await state.prep(prepare_completions, state, await json_body(request))
    streams, echo_lp, plp = await start(state, req, prompts, echo, opts, k, arrival)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    prompt_tokens = sum(len(x) for x in prompts)
    if req.stream:
        writer = ChunkWriter(rid, "text_completion", created, state.served_name(req.model), prompt_tokens,
                             req.stream_options)
        chunks = CompletionStream(state, req, writer, echo, echo_lp, k).chunks(streams, len(prompts))
        return StreamingResponse(writer.stream(chunks, streams), media_type="text/event-stream")
    try:
        outs = await asyncio.gather(*(collect(request, s) for s in streams))
    finally:
        for s in streams:
            s.abort()
    if not streams:  # max_tokens 0: the prompts only
        outs = [[empty_sample("length")] * req.n for _ in prompts]
    choices = completion_choices(state, req, outs, echo, echo_lp, plp, k)
    completion_tokens = sum(len(o["ids"]) for out in outs for o in out)
    return {"id": rid, "object": "text_completion", "created": created, "model": state.served_name(req.model),
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def completion_choices(state: ServeState, req, outs, echo, echo_lp, plp, k: int) -> list[dict]:
    """The choices of a whole (non-streamed) answer: per prompt, per sample, its text (after the echoed prompt)."""
    choices = []
    name = state.token_namer(req)
    for pi, out in enumerate(outs):
        prefix = echo[pi]["text"] if echo else ""
        for si, o in enumerate(out):
            d = state.detokenizer(req)
            d.ids = o["ids"]
            text = d.final_text(o["stop_text"], o["finish"])
            lp = None
            if req.logprobs is not None:
                offsets = token_offsets(state.tokenizer, o["ids"], skip_special_tokens=req.skip_special_tokens)
                lp = completion_part(name, o["ids"], o["logprobs"], o["top"], [min(x, len(text)) for x in offsets],
                                     k, len(prefix))
                lp = joined(echo_lp[pi] if echo_lp else None, lp)
            choices.append({"index": pi * req.n + si, "text": prefix + text, "logprobs": lp,
                            "finish_reason": o["finish"] or "abort",
                            **({"prompt_logprobs": plp[pi]} if plp is not None else {})})
    return choices


def _no_logprobs() -> dict:
    return {"ids": [], "lps": [], "tops": [], "offsets": []}


class CompletionStream:
    """One streamed completion answer: per (prompt, sample), its detokenizer and the log-probs of tokens whose text
    is not sent yet."""

    def __init__(self, state: ServeState, req, writer: ChunkWriter, echo, echo_lp, k: int):
        self.state, self.req, self.writer, self.echo, self.echo_lp, self.k = state, req, writer, echo, echo_lp, k
        self.name = state.token_namer(req)
        self.detoks: dict = {}
        self.held: dict = {}

    async def chunks(self, streams, num_prompts: int):
        req, writer = self.req, self.writer
        if self.echo:  # the prompt first, as its own chunk per choice
            for pi in range(num_prompts):
                for si in range(req.n):
                    yield writer.chunk({"index": pi * req.n + si, "text": self.echo[pi]["text"],
                                        "logprobs": self.echo_lp[pi] if self.echo_lp else None,
                                        "finish_reason": None if streams else "length"})
        batches = EventBatches(streams)
        try:
            async for batch in batches:
                by_key: dict[tuple[int, int], list] = {}  # (prompt, sample) -> its events in this batch
                for pi, ev in batch:
                    if isinstance(ev, Exception):
                        yield writer.error(ev)
                        continue
                    by_key.setdefault((pi, ev.index), []).append(ev)
                for key, evs in by_key.items():
                    text = self.text_chunk(key, evs) if req.logprobs is None else self.logprob_chunk(key, evs)
                    if text is not None:
                        yield text
        finally:
            batches.close()

    def detokenizer(self, key):
        d = self.detoks.get(key)
        if d is None:
            d = self.detoks[key] = self.state.detokenizer(self.req)
        return d

    def text_chunk(self, key: tuple[int, int], evs: list) -> str | None:
        """Without log-probs: the new text of (prompt, sample) ``key`` (None: held back)."""
        d, last, writer = self.detokenizer(key), evs[-1], self.writer
        finish = last.finish_reason
        ids = [ev.token_id for ev in evs if ev.token_id is not None]
        writer.completion_tokens += len(ids)
        if finish is None:
            text = d.push_many(ids)
        else:  # the last token's text goes out through flush, once the stop string is known
            d.ids.extend(ids)
            text = d.flush(last.stop_text, finish)
        if not text and finish is None:
            return None  # held back (an incomplete character, what may start a stop string)
        index = key[0] * self.req.n + key[1]
        if writer.every:
            return writer.chunk({"index": index, "text": text, "logprobs": None, "finish_reason": finish})
        # the hot path: a template, no dict, no json.dumps
        return writer.plain(index, f'"text":{json_str(text)},"logprobs":null,"finish_reason":'
                                   f'{"null" if finish is None else json_str(finish)}')

    def logprob_chunk(self, key: tuple[int, int], evs: list) -> str | None:
        """With log-probs: the new text of ``key`` and its tokens' log-probs and offsets (None: held back)."""
        d, last = self.detokenizer(key), evs[-1]
        finish = last.finish_reason
        h = self.held.setdefault(key, _no_logprobs())
        text = ""
        for ev in evs:  # per token: each one's offset in the text
            if ev.token_id is not None:
                self.writer.completion_tokens += 1
                h["offsets"].append(d.offset)
                text += d.push(ev.token_id, emit=ev.finish_reason is None)
                h["ids"].append(ev.token_id)
                h["lps"].append(ev.logprob)
                h["tops"].append(ev.top)
        if finish is not None:
            text += d.flush(last.stop_text, finish)
        if not (text or finish is not None):
            return None  # held back: its log-probs go with the next chunk that carries text
        sent = d.sent  # offsets index into the text sent so far
        shift = len(self.echo[key[0]]["text"]) if self.echo else 0
        lp = completion_part(self.name, h["ids"], h["lps"], h["tops"], [min(x, sent) for x in h["offsets"]],
                             self.k, shift)
        self.held[key] = _no_logprobs()
        return self.writer.chunk({"index": key[0] * self.req.n + key[1], "text": text, "logprobs": lp,
                                  "finish_reason": finish})


def add_completion_routes(app, state: ServeState) -> None:
    app.add_api_route("/v1/completions", completions, methods=["POST"],
                      openapi_extra=request_body(CompletionRequest, vocab=state.vocab))
