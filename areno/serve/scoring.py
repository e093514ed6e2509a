"""Prompt log-probs (``echo`` with ``logprobs`` on /v1/completions, what lm-evaluation-harness's loglikelihood
tasks send, and vLLM's ``prompt_logprobs`` on both generation routes): one plain forward of the model over the
prompt, run by the thread that owns the engine, between two of its steps, so it never races a decode step; under
tensor parallelism every rank of the group runs it (``PromptForward``, broadcast like a step).

``ServeEngine`` is the server's ``AsyncEngine`` with :meth:`ServeEngine.run_on_engine`: a function of the engine,
run on the engine thread. ``ReplicaPool`` offers the same method (run in a replica process).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from areno.engine.async_engine import AsyncEngine
from areno.engine.model_runner import broadcast_step
from areno.serve.errors import APIError

SCORE_TOKENS_PER_FORWARD = 8192  # prompts packed into one forward up to this many tokens
LOGITS_ROWS_PER_CHUNK = 512  # fp32 [rows, vocab] log-softmax at a time


def score_groups(prompts: list[list[int]], budget: int = SCORE_TOKENS_PER_FORWARD) -> list[list[int]]:
    """Indices of ``prompts`` packed greedily into forwards of at most ``budget`` tokens (a longer one alone)."""
    groups, current, size = [], [], 0
    for i, p in enumerate(prompts):
        if current and size + len(p) > budget:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += len(p)
    if current:
        groups.append(current)
    return groups


@dataclass
class PromptForward:
    """Prompts' log-probs from one packed plain forward, run by every rank of the engine's TP group: rank 0 (the
    engine thread) broadcasts it the way it broadcasts a decode step, and the followers' ``TPWorker`` calls it with
    their runner, so every rank takes part in the forward's and the logits' collectives in the same order."""

    prompts: list[list[int]]
    k: int  # top candidates per position (0: none)
    ranks: bool  # also each token's rank: how many tokens are at least as likely (1: the likeliest)

    def __call__(self, runner=None, model=None):
        model = runner.model if runner is not None else model
        device = next(model.parameters()).device
        logits_of = runner.logits if runner is not None else (lambda h: model.compute_logits(h).float())
        prompts, k = self.prompts, self.k
        cu = [0]
        for p in prompts:
            cu.append(cu[-1] + len(p))
        out = []
        with torch.inference_mode():
            ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
            positions = torch.cat([torch.arange(len(p), dtype=torch.int64) for p in prompts]).to(device)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
            hidden = model(ids, positions, cu_t, max(len(p) for p in prompts))
            for i in range(len(prompts)):
                lps, tops, ranks = [], ([] if k else None), ([] if self.ranks else None)
                for a in range(cu[i], cu[i + 1] - 1, LOGITS_ROWS_PER_CHUNK):
                    b = min(a + LOGITS_ROWS_PER_CHUNK, cu[i + 1] - 1)
                    lp = torch.log_softmax(logits_of(hidden[a:b]).float(), dim=-1)
                    own = lp.gather(1, ids[a + 1 : b + 1, None])
                    lps += own[:, 0].tolist()
                    if self.ranks:
                        ranks += (lp >= own).sum(-1).tolist()  # as vLLM: ties rank after the token
                    if k:
                        vals, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
                        tops += [list(zip(r_ids, r_vals)) for r_ids, r_vals in zip(top_ids.tolist(), vals.tolist())]
                out.append((lps, tops, ranks))
        return out


def prompt_logprobs(engine, prompts: list[list[int]], k: int, ranks: bool = False):
    """For each prompt: (log p(token t | tokens < t) for t >= 1, the ``k`` most likely (id, log-prob) at each of
    those positions when ``k`` > 0 else None, each token's rank when ``ranks`` else None), from the untempered fp32
    log-softmax of one packed forward. Runs on the engine thread (``engine`` is the ``Engine``); under tensor
    parallelism the followers run the same forward on their shards."""
    job = PromptForward([list(p) for p in prompts], k, ranks)
    runner = getattr(engine, "runner", None)
    group = engine.model.tp_group
    if group is not None:
        if runner is None:
            raise ValueError("prompt log-probs need the engine's runner under --tp-size > 1")
        broadcast_step(job, group)
    return job(runner) if runner is not None else job(model=engine.model)


def vllm_prompt_logprobs(ids: list[int], score, k: int, name) -> list:
    """vLLM's ``prompt_logprobs`` of one prompt: None for the first token, then per token {token id: {"logprob",
    "rank", "decoded_token"}} holding the prompt's own token and the ``k`` likeliest (ranks 1..k), the own token
    first. ``score`` is ``prompt_logprobs``'s tuple for this prompt, computed with ranks and at least ``k`` top."""
    lps, tops, ranks = score
    out = [None]
    for pos, (tid, lp, rank) in enumerate(zip(ids[1:], lps, ranks)):
        entry = {tid: {"logprob": lp, "rank": rank, "decoded_token": name(tid)}}
        for r, (t, v) in enumerate((tops[pos] if tops else [])[:k], start=1):
            entry.setdefault(t, {"logprob": v, "rank": r, "decoded_token": name(t)})
        out.append(entry)
    return out


class ServeEngine(AsyncEngine):
    """``AsyncEngine`` plus :meth:`run_on_engine`. The call goes through the engine thread's command queue, so it
    runs between two engine steps (a decode step never sees it half done)."""

    reopen_when_idle = True

    async def run_on_engine(self, fn, *args):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._thread.is_alive():
            raise APIError(503, "the engine is not running", type="server_error")
        self._commands.put(("call", (fn, args, loop, future)))
        self._wake.set()
        while True:  # a stopped engine thread never answers: do not wait for it forever
            done, _ = await asyncio.wait({future}, timeout=1.0)
            if done:
                return future.result()
            if not self._thread.is_alive():
                raise APIError(503, "the engine stopped before answering", type="server_error")

    def _apply(self, cmd, arg) -> None:
        if cmd != "call":
            super()._apply(cmd, arg)
            return
        fn, args, loop, future = arg
        try:
            result, error = fn(self.engine, *args), None
        except Exception as exc:  # the caller's, not the engine's, failure
            result, error = None, exc

        def settle():
            if not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # that event loop is closed: nobody is waiting
            pass
