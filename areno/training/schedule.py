"""Learning-rate schedules: constant, linear or cosine decay to ``min_lr``, after an optional linear warmup.

``lr(i)`` is the rate of optimizer update ``i`` (0-based), a pure function of ``i``, so resuming only needs the
update count. Warmup ramps ``lr * (i + 1) / warmup_steps`` for ``i < warmup_steps``: the first update already
moves (``lr / warmup_steps``) and update ``warmup_steps - 1`` uses the full ``lr``. Decay then runs over updates
``warmup_steps .. total_steps``: with ``t = (i - warmup_steps) / (total_steps - warmup_steps)`` clamped to [0, 1],

    linear: min_lr + (lr - min_lr) * (1 - t)
    cosine: min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2

so update ``warmup_steps`` uses ``lr`` and ``min_lr`` is reached at ``i = total_steps`` (and held after; with
``total_steps <= warmup_steps``, ``min_lr`` follows the warmup at once).
"""

from __future__ import annotations

import math

from areno.config.constants import LR_STYLES


class LRSchedule:
    def __init__(self, lr: float, *, min_lr: float = 0.0, warmup_steps: int = 0, total_steps: int | None = None,
                 style: str = "constant"):
        if style not in LR_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(LR_STYLES)}, not {style!r}")
        if lr < 0 or min_lr < 0:
            raise ValueError(f"--lr ({lr}) and --min-lr ({min_lr}) must be >= 0")
        if warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, not {warmup_steps}")
        if style != "constant":
            if min_lr > lr:
                raise ValueError(f"--min-lr ({min_lr}) must not exceed --lr ({lr})")
            if total_steps is None or total_steps < 1:
                raise ValueError(f"--lr-decay-style {style} needs the total number of updates, got {total_steps}")
        self.base_lr, self.min_lr = lr, min_lr
        self.warmup_steps, self.total_steps, self.style = warmup_steps, total_steps, style

    def lr(self, update_index: int) -> float:
        i = update_index
        if i < self.warmup_steps:
            return self.base_lr * (i + 1) / self.warmup_steps
        if self.style == "constant":
            return self.base_lr
        span = self.total_steps - self.warmup_steps
        t = min(1.0, (i - self.warmup_steps) / span) if span > 0 else 1.0
        if self.style == "linear":
            scale = 1.0 - t
        else:
            scale = 0.5 * (1.0 + math.cos(math.pi * t))
        return self.min_lr + (self.base_lr - self.min_lr) * scale

    def state_dict(self) -> dict:
        """The settings (the schedule has no other state: the update index lives with the trainer)."""
        return {"lr": self.base_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "style": self.style}

    @classmethod
    def from_state_dict(cls, sd: dict) -> LRSchedule:
        return cls(sd["lr"], min_lr=sd["min_lr"], warmup_steps=sd["warmup_steps"], total_steps=sd["total_steps"],
                   style=sd["style"])
