"""What both generation routes (chat and text completions) do with a parsed request: check its fields against the
vocabulary, turn it into the engine's ``SamplingParams``, submit it, gather its events (aborting when the client
goes away), and score prompts for their log-probs."""

from __future__ import annotations

import asyncio

from areno.config import SamplingParams
from areno.serve.errors import APIError
from areno.serve.limits import context_exceeded
from areno.serve.lora import adapter_for, check_adapter_request
from areno.serve.protocol import ChatCompletionRequest
from areno.serve.sampling import request_sampling_params
from areno.serve.scoring import prompt_logprobs, score_groups
from areno.serve.state import ServeState

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request looks whether its client is still there


def check_request(state: ServeState, req) -> None:
    """What a request's fields mean beyond their schema: token ids inside the vocabulary, notes on fields accepted
    and ignored."""
    vocab, note = state.vocab, state.notes
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
    if effort is not None and "reasoning_effort" not in state.template_text:
        note("reasoning_effort", "passed to the chat template, which does not use it")


def sampling_options(state: ServeState, req, prompt_len: int, max_tokens: int | None,
                     top_logprobs: int) -> SamplingParams:
    """The engine's options for a request whose prompt has ``prompt_len`` tokens; a 400 when the prompt and
    ``max_tokens`` do not fit the context or ``n`` exceeds --max-running-prompts."""
    max_model_len = state.max_model_len
    if prompt_len >= max_model_len:
        raise context_exceeded(f"{prompt_len} tokens", max_model_len,
                               "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    room = max_model_len - prompt_len
    if max_tokens is not None and max_tokens > room:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{name} ({max_tokens}) + prompt ({prompt_len} tokens) exceeds the context "
                       f"({max_model_len})", param=name, code="context_length_exceeded")
    if req.n > state.max_running:
        raise APIError(400, f"n ({req.n}) exceeds --max-running-prompts ({state.max_running})", param="n")
    params = request_sampling_params(req, max_new_tokens=max_tokens or room, top_logprobs=top_logprobs)
    if state.loras is not None:  # the request's model may name a LoRA adapter (areno.serve.lora)
        params.lora = adapter_for(state, req.model)
        check_adapter_request(req, params.lora)
    return params


async def submit(state: ServeState, prompt_ids, opts: SamplingParams, arrival: float, mm=None):
    """The request on the engine, as a metered stream of events; what the engine refuses is a 400."""
    engine = state.engine
    try:
        stream = await (engine.submit(prompt_ids, opts) if mm is None else engine.submit(prompt_ids, opts, mm=mm))
    except APIError:
        raise
    except Exception as exc:
        raise APIError(400, str(exc)) from exc
    return state.metrics.track(stream, len(prompt_ids), arrival)


def empty_sample(finish: str | None = None) -> dict:
    return {"ids": [], "logprobs": [], "top": [], "finish": finish, "stop_text": None}


async def collect(request, stream) -> list[dict]:
    """Gather a request's events per sample, aborting it if the client disconnects meanwhile."""
    out = [empty_sample() for _ in range(stream.options.n)]
    it = stream.__aiter__()
    while True:
        nxt = asyncio.ensure_future(it.__anext__())
        while not nxt.done():
            done, _ = await asyncio.wait({nxt}, timeout=DISCONNECT_POLL_S)
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


async def score_prompts(state: ServeState, prompts: list[list[int]], k: int, ranks: bool = False,
                        param: str = "echo") -> list:
    """Each prompt's (token log-probs from its second token on, top-k per position, ranks) from the engine's
    model."""
    run_on_engine = getattr(state.engine, "run_on_engine", None)
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
