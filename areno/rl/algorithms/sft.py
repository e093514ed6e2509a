"""SFT: one pass of optimizer updates over the rows' tokenised responses (mean NLL of the response tokens)."""

from __future__ import annotations

import time

from areno.rl.algorithms.base import Algorithm, normalise
from areno.rl.algorithms.loss_fns import sft_loss_fn
from areno.training.batch import Row


def step(ctx, batch, upcoming=None) -> dict:
    cfg = ctx.cfg
    rows = [Row(p.ids, p.responses["response"], media=ctx.media_of(p)) for p in batch]
    t0 = time.perf_counter()
    s = ctx.trainer.train(rows, sft_loss_fn(), cfg.mini_bs, cfg.gradient_accumulation_steps)
    m = normalise(s)
    m["train_s"] = time.perf_counter() - t0
    m["train_tok_s"] = sum(len(r) for r in rows) / max(1e-9, m["train_s"])
    return m


STEP = Algorithm(step, responses=("response",))
