"""Weights & Biases logging (--wandb-project): every metric MetricsLogger writes, the resolved configuration, the
pictures (reward curve with its evaluation panels) and sample tables, in the mode --wandb-mode names (offline runs
go under <metrics folder>/wandb, for `wandb sync`).

W&B's own step must only grow, but areno logs the SFT warm-up at steps <= 0 before RL step 1 and evaluation at the
step it follows: every row is logged with its areno step as ``train_step``, the x-axis of every metric
(``define_metric``), and W&B's own counter just orders the rows.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from areno.config import ConfigError


class WandbRun:
    """One W&B run for the training run of ``cfg`` (rank 0 only)."""

    def __init__(self, cfg, metrics_dir):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError("--wandb-project", "needs the wandb package (pip install wandb)") from e
        self.wandb = wandb
        folder = Path(metrics_dir)
        folder.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, mode=cfg.wandb_mode,
                              dir=str(folder), config=asdict(cfg), reinit="finish_previous")
        self.run.define_metric("train_step")
        self.run.define_metric("*", step_metric="train_step")

    def log(self, step: int, metrics: dict) -> None:
        if metrics:
            self.run.log({**metrics, "train_step": int(step)})

    def image(self, key: str, path, step: int) -> None:
        self.log(step, {key: self.wandb.Image(str(path))})

    def table(self, key: str, rows: list[dict], step: int) -> None:
        """``rows`` (dicts with the same keys) as one W&B table; values that are not numbers become text."""
        if not rows:
            return
        columns = list(rows[0])
        data = [[v if isinstance(v, (int, float, bool)) or v is None else str(v) for v in (r[c] for c in columns)]
                for r in rows]
        self.log(step, {key: self.wandb.Table(columns=columns, data=data)})

    def finish(self) -> None:
        self.run.finish()
