"""Per-step metrics: JSON lines, TensorBoard scalars and a compact stdout line; a reward-curve plot.

Only rank 0 writes anything. ``metrics.jsonl`` gets one object per logged step, ``{"step", "time", ...}`` with float
values (non-finite ones as null); TensorBoard events go to ``<metrics_dir>/tb``; the stdout line goes through
``tqdm.write`` so it sits above the progress bar instead of breaking it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

log = logging.getLogger("areno.metrics")

# (metric key, label, format) in the order they appear on the stdout line; reward mean/std and step time are special
LINE = (
    ("eval_accuracy", "eval", "{:.3f}"),
    ("loss", "loss", "{:.4g}"),
    ("nll", "nll", "{:.4g}"),
    ("kl", "kl", "{:.3g}"),
    ("logprob_diff", "lp_diff", "{:.3g}"),
    ("clip_frac", "clip", "{:.3g}"),
    ("entropy", "ent", "{:.3g}"),
    ("grad_norm", "gnorm", "{:.3g}"),
    ("lr", "lr", "{:.2e}"),
    ("zero_variance_groups", "zero_var", "{:.0f}"),
    ("rollout_tok_s", "rollout", "{:.0f} tok/s"),
    ("train_tok_s", "train", "{:.0f} tok/s"),
)


def _clean(value):
    """A JSON-safe value: numbers as floats (non-finite -> None), tensors unwrapped, strings kept."""
    if isinstance(value, (bool, int, float)) or (hasattr(value, "__float__") and not isinstance(value, (str, bytes))):
        try:
            x = float(value)  # also one-element tensors and numpy scalars
        except (TypeError, ValueError, RuntimeError):
            return str(value)
        return x if math.isfinite(x) else None
    if value is None or isinstance(value, str):
        return value
    return str(value)


def format_line(step: int, metrics: dict) -> str:
    """``step 12 | reward 0.41±0.22 | loss ... | rollout 1234 tok/s | 3.2s`` with the keys that exist."""
    parts = [f"step {step}"]
    r, s = metrics.get("reward_mean"), metrics.get("reward_std")
    if r is not None:
        parts.append(f"reward {r:.3f}" + (f"±{s:.3f}" if s is not None else ""))
    for key, label, fmt in LINE:
        v = metrics.get(key)
        if v is not None:
            parts.append(f"{label} {fmt.format(v)}")
    if metrics.get("step_s") is not None:
        parts.append(f"{metrics['step_s']:.1f}s")
    return " | ".join(parts)


class MetricsLogger:
    def __init__(self, metrics_dir, *, tensorboard: bool = True, rank: int = 0, stdout: bool = True):
        self.metrics_dir = Path(metrics_dir)
        self.active = rank == 0
        self.stdout = stdout
        self.tensorboard = tensorboard
        self._writer = None
        self._file = None
        if self.active:
            self.metrics_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.metrics_dir / "metrics.jsonl", "a", encoding="utf-8")

    @property
    def jsonl_path(self) -> Path:
        return self.metrics_dir / "metrics.jsonl"

    def log(self, step: int, metrics: dict, *, stdout: bool = True) -> None:
        """One JSON line (and TensorBoard scalars); also a compact stdout line unless ``stdout`` is False."""
        if not self.active or self._file is None:
            return
        clean = {k: _clean(v) for k, v in metrics.items() if k not in ("step", "time")}
        self._file.write(json.dumps({"step": int(step), "time": time.time(), **clean}, allow_nan=False) + "\n")
        self._file.flush()
        writer = self._tb()
        if writer is not None:
            for k, v in clean.items():
                if isinstance(v, float):
                    writer.add_scalar(k, v, int(step))
            writer.flush()
        if self.stdout and stdout:
            from tqdm import tqdm

            tqdm.write(format_line(int(step), {k: v for k, v in clean.items() if isinstance(v, float)}))

    def _tb(self):
        if not self.tensorboard:
            return None
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                log.warning("TensorBoard events are off: %s (pip install tensorboard); JSON lines still go to %s",
                            e, self.jsonl_path)
                self.tensorboard = False
                return None
            self._writer = SummaryWriter(str(self.metrics_dir / "tb"))
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(jsonl_path) -> list[dict]:
    with open(jsonl_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_reward_curve(jsonl_path, png_path, key: str = "reward_mean", title: str | None = None,
                      since: float | None = None) -> Path:
    """Plot ``key`` over steps from a metrics.jsonl (with a ±std band for reward_mean and a moving average);
    ``since`` (a Unix time) keeps only the records logged from then on, e.g. this run's in an appended file."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = [(r["step"], r[key], r.get("reward_std")) for r in read_metrics(jsonl_path)
              if r.get(key) is not None and (since is None or r.get("time", since) >= since)]
    if not points:
        raise ValueError(f"{jsonl_path} has no {key!r} values to plot")
    points.sort(key=lambda p: p[0])
    steps, values = [p[0] for p in points], [p[1] for p in points]
    fig = Figure(figsize=(7, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, values, marker="o" if len(points) < 40 else None, lw=1, alpha=0.6, label=key)
    if key == "reward_mean" and all(p[2] is not None for p in points):
        ax.fill_between(steps, [v - p[2] for v, p in zip(values, points)], [v + p[2] for v, p in zip(values, points)],
                        alpha=0.15, label="± std")
    w = max(1, len(values) // 10)
    if w > 1:
        avg = [sum(values[max(0, i - w + 1) : i + 1]) / len(values[max(0, i - w + 1) : i + 1])
               for i in range(len(values))]
        ax.plot(steps, avg, lw=2, label=f"moving average ({w})")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title or f"{key} over training")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    return png_path
