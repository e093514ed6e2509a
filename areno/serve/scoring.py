"""Prompt log-probs (``echo`` with ``logprobs`` on /v1/completions, what lm-evaluation-harness's loglikelihood
tasks send): one plain forward of the model over the prompt, run by the thread that owns the engine, between two of
its steps, so it never races a decode step.

``ServeEngine`` is the server's ``AsyncEngine`` with :meth:`ServeEngine.run_on_engine`: a function of the engine,
run on the engine thread. ``ReplicaPool`` offers the same method (run in a replica process).
"""

from __future__ import annotations

import asyncio

import torch

from areno.rollout.async_engine import AsyncEngine
from areno.serve.protocol import APIError

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


def prompt_logprobs(engine, prompts: list[list[int]], k: int):
    """For each prompt: (log p(token t | tokens < t) for t >= 1, and when ``k`` > 0 the ``k`` most likely
    (id, log-prob) at each of those positions, else None), from the untempered fp32 log-softmax of one packed
    forward. Runs on the engine thread (``engine`` is the ``Engine``)."""
    model = engine.model
    if getattr(model, "tp_group", None) is not None:
        raise ValueError("echo with logprobs (prompt log-probs) is not supported yet with --tp-size > 1")
    device = next(model.parameters()).device
    runner = getattr(engine, "runner", None)
    logits_of = runner.logits if runner is not None else (lambda h: model.compute_logits(h).float())
    flat = [t for p in prompts for t in p]
    cu = [0]
    for p in prompts:
        cu.append(cu[-1] + len(p))
    out = []
    with torch.inference_mode():
        ids = torch.tensor(flat, dtype=torch.int64, device=device)
        positions = torch.cat([torch.arange(len(p), dtype=torch.int64) for p in prompts]).to(device)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        hidden = model(ids, positions, cu_t, max(len(p) for p in prompts))
        for i in range(len(prompts)):
            lps, tops = [], ([] if k else None)
            for a in range(cu[i], cu[i + 1] - 1, LOGITS_ROWS_PER_CHUNK):
                b = min(a + LOGITS_ROWS_PER_CHUNK, cu[i + 1] - 1)
                lp = torch.log_softmax(logits_of(hidden[a:b]).float(), dim=-1)
                lps += lp.gather(1, ids[a + 1 : b + 1, None])[:, 0].tolist()
                if k:
                    vals, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
                    tops += [list(zip(r_ids, r_vals)) for r_ids, r_vals in zip(top_ids.tolist(), vals.tolist())]
            out.append((lps, tops))
    return out


class ServeEngine(AsyncEngine):
    """``AsyncEngine`` plus :meth:`run_on_engine`. The call goes through the engine thread's command queue, so it
    runs between two engine steps (a decode step never sees it half done)."""

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
