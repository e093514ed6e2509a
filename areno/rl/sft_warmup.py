"""``--sft-warmup-steps``: SFT steps on the rows' responses before the RL steps (``TrainLoop.warmup``).

The warm-up has a schedule of its own (the same shape, peak ``--sft-warmup-lr`` or ``--lr``, over its own updates)
and trains at temperature 1: the RL schedule and the rollout temperature apply to the RL steps only, and the RL
schedule starts fresh after it. With LoRA the warm-up trains the base (its own optimizer, the adapter off). It is
skipped when a resumed run is past it; the quickstart's is cached (``warmup_cache``).
"""

from __future__ import annotations

from tqdm import tqdm

from areno.config import ConfigError
from areno.rl import setup, warmup_cache
from areno.rl.algorithms import sft, updates_per_step
from areno.rl.stop_rules import check_stop
from areno.training import lora, multimodal
from areno.training.data import PromptIterator
from areno.training.schedule import LRSchedule


def sft_warmup(loop) -> dict:
    """Run the warm-up of the ``TrainLoop`` ``loop``; returns its last step's metrics ({} when none ran)."""
    cfg = loop.cfg
    if not cfg.sft_warmup_steps or not loop.algorithm.needs_reward or loop.step_index > 0:
        lora.quantize_pending(loop.model)  # --quantize-base nf4 waited for a warm-up that does not run
        return {}
    rows = loop.tokenize([(p.index, p.row) for p in loop.rows if p.row.get("response") is not None],
                         responses=("response",), label="--sft-warmup-steps rows")  # none past the context
    if not rows:
        raise ConfigError("--sft-warmup-steps", "needs rows with a `response` (that fits the model's context)")
    cache = warmup_cache.entry(cfg, rows, loop.model, loop.device, loop.dp_size * cfg.tp_size)  # quickstart
    if cache is not None and cache.load(loop.model, loop.trainer, loop.logger, loop.is_main):
        return cache.last
    data = iter(PromptIterator(rows, cfg.batch_size, seed=cfg.seed + 1, epochs=None))
    lr, t = cfg.sft_warmup_lr or cfg.lr, loop.trainer
    full = lora.train_base(loop.model)  # LoRA: the warm-up trains the base (its optimizer, adapter off)
    if full:
        loop.ctx.trainer = t = setup.make_trainer(cfg, loop.model, lr, 1, loop.groups)
    saved = t.schedule, t.temperature, t.group_schedules
    updates = cfg.sft_warmup_steps * updates_per_step(cfg, cfg.batch_size, loop.dp_size)
    t.schedule = LRSchedule(lr, min_lr=min(cfg.min_lr, lr), warmup_steps=cfg.warmup_steps, total_steps=updates,
                            style=cfg.lr_decay_style)
    t.group_schedules = multimodal.group_schedules(cfg, t.optimizer.groups, lr=lr, total_updates=updates)
    t.temperature = 1.0
    m, log = {}, cache.recorder(loop.logger.log) if cache is not None else loop.logger.log
    bar = tqdm(total=cfg.sft_warmup_steps, desc="sft warm-up", dynamic_ncols=True) if loop.is_main else None
    try:
        for i in range(cfg.sft_warmup_steps):
            m = sft.step(loop.ctx, next(data))
            if loop.is_main and (i + 1) % max(1, cfg.log_interval) == 0:
                # JSON lines only: the progress bar carries the loss instead of one stdout line per step
                log(-(cfg.sft_warmup_steps - i - 1), {"warmup_" + k: v for k, v in m.items()}, stdout=False)
            if bar is not None:
                bar.set_postfix(loss=f"{m.get('loss', float('nan')):.3f}", refresh=False)
                bar.update(1)
            check_stop(loop, saved=True)  # no step to save during the warm-up
    finally:
        if bar is not None:
            bar.close()
        t.schedule, t.temperature, t.group_schedules = saved
        t.num_updates = 0  # the RL schedule starts fresh
        if full:
            lora.end_train_base(loop.model)
            loop.ctx.trainer = loop.trainer
    if cache is not None:
        cache.save(loop.model, loop.trainer)
    return m
