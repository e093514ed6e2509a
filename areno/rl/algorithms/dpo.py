"""DPO: each row's (chosen, rejected) responses as adjacent rows, scored by the frozen reference, then one pass of
sigmoid-DPO updates over the pairs."""

from __future__ import annotations

import time

from areno.rl.algorithms.base import Algorithm, normalise
from areno.rl.algorithms.loss_fns import dpo_loss_fn
from areno.training.batch import Row


def step(ctx, batch, upcoming=None) -> dict:
    cfg = ctx.cfg
    rows = []
    for p in batch:
        media = ctx.media_of(p)
        prompt = p.ids or [ctx.eos_id]
        rows += [Row(prompt, p.responses["chosen"], media=media), Row(prompt, p.responses["rejected"], media=media)]
    for row, lp in zip(rows, ctx.trainer.compute_logprobs(rows, cfg.mini_bs * 2, model=ctx.ref)):
        row.extras["ref"] = float(sum(lp))
    t0 = time.perf_counter()
    s = ctx.trainer.train(rows, dpo_loss_fn(cfg), cfg.mini_bs, cfg.gradient_accumulation_steps, unit=2)
    m = normalise(s)
    m["train_s"] = time.perf_counter() - t0
    return m


STEP = Algorithm(step, needs_ref=True, responses=("chosen", "rejected"), prompt_optional=True)
