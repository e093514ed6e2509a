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
        self._purge_step = None
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

    def truncate_after(self, step: int) -> None:
        """Forget what was logged after ``step`` (a resumed run redoes those steps): metrics.jsonl keeps its lines
        up to ``step`` (rewritten atomically) and TensorBoard purges the later events on its next write."""
        if not self.active or self._file is None:
            return
        self._file.close()
        path = self.jsonl_path
        keep = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep), encoding="utf-8")
        tmp.replace(path)
        self._file = open(path, "a", encoding="utf-8")
        self._purge_step = step + 1

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
            self._writer = SummaryWriter(str(self.metrics_dir / "tb"), purge_step=self._purge_step)
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


def reward_band(records: list[dict], key: str = "reward_mean") -> tuple[list, list, list] | None:
    """The ±std band around ``key`` per step, as (steps, lower, upper), clipped to the rewards' observed range: a
    band may not claim rewards that never occurred (with 0/1 rewards, mean + std often passes 1). Each step is
    clipped to its logged ``reward_min`` / ``reward_max`` where present; otherwise to the range observed over the
    run (the lowest and highest logged per-step minimum / maximum, or mean where those are absent). None without a
    ``reward_std`` on every record."""
    points = sorted((r for r in records if r.get(key) is not None), key=lambda r: r["step"])
    if not points or any(r.get("reward_std") is None for r in points):
        return None
    lo = min(r["reward_min"] if r.get("reward_min") is not None else r[key] for r in points)
    hi = max(r["reward_max"] if r.get("reward_max") is not None else r[key] for r in points)
    steps, lower, upper = [], [], []
    for r in points:
        low = r["reward_min"] if r.get("reward_min") is not None else lo
        high = r["reward_max"] if r.get("reward_max") is not None else hi
        steps.append(r["step"])
        lower.append(min(max(r[key] - r["reward_std"], low), r[key]))
        upper.append(max(min(r[key] + r["reward_std"], high), r[key]))
    return steps, lower, upper


def plot_reward_curve(jsonl_path, png_path, key: str = "reward_mean", title: str | None = None,
                      since: float | None = None) -> Path:
    """Plot ``key`` over steps from a metrics.jsonl (with a ±std band for reward_mean, clipped to the observed
    reward range: see ``reward_band``, and a moving average); ``since`` (a Unix time) keeps only the records
    logged from then on, e.g. this run's in an appended file."""
    fig = reward_curve_figure(read_metrics(jsonl_path), key, title=title, since=since, source=jsonl_path)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    return png_path


def reward_curve_figure(records: list[dict], key: str = "reward_mean", *, title: str | None = None,
                        since: float | None = None, source=None):
    """The matplotlib figure ``plot_reward_curve`` saves: ``key`` per step, for reward_mean its ±std band and the
    held-out accuracy the run prints (before RL at step 0, each evaluation, after RL); the legend below the plot."""
    if logging.getLogger("matplotlib").level == logging.NOTSET:  # no INFO lines (font cache) in the run's output
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    everything = [r for r in records if since is None or r.get("time", since) >= since]
    records = [r for r in everything if r.get(key) is not None]
    if not records:
        raise ValueError(f"{source or 'the metrics'} has no {key!r} values to plot")
    records.sort(key=lambda r: r["step"])
    steps, values = [r["step"] for r in records], [r[key] for r in records]
    fig = Figure(figsize=(7, 4.6), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, values, marker="o" if len(records) < 40 else None, lw=1, alpha=0.6, label=key)
    band = reward_band(records, key) if key == "reward_mean" else None
    if band is not None:
        ax.fill_between(band[0], band[1], band[2], alpha=0.15, label="± std (within the observed rewards)")
    w = max(1, len(values) // 10)
    if w > 1:
        avg = [sum(values[max(0, i - w + 1) : i + 1]) / len(values[max(0, i - w + 1) : i + 1])
               for i in range(len(values))]
        ax.plot(steps, avg, lw=2, label=f"moving average ({w})")
    held_out = eval_points(everything) if key == "reward_mean" else []
    if held_out:
        xs, ys = zip(*held_out)
        ax.plot(xs, ys, marker="s", ls="--", lw=1.5, color="C3", label="held-out accuracy (greedy)")
        labels = [(held_out[0], (4, -12))] + ([(held_out[-1], (-34, 7))] if len(held_out) > 1 else [])
        for (x, y), offset in labels:  # the headline's figures: before RL, and the last evaluation
            ax.annotate(f"{y:.1%}", (x, y), textcoords="offset points", xytext=offset, color="C3", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title or f"{key} over training")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=2, frameon=False, fontsize=9)  # below the axes, off the data
    return fig


def eval_points(records: list[dict]) -> list[tuple[int, float]]:
    """The held-out accuracy a run logged, as (step, accuracy) in step order: before RL at step 0
    (``eval_accuracy_before``), each ``eval_accuracy`` and the final ``eval_accuracy_after`` (at its step)."""
    points = {}
    for r in sorted(records, key=lambda r: r["step"]):
        if r.get("eval_accuracy_before") is not None:
            points[0] = r["eval_accuracy_before"]
        if r.get("eval_accuracy") is not None:
            points[r["step"]] = r["eval_accuracy"]
        if r.get("eval_accuracy_after") is not None:
            points[r["step"]] = r["eval_accuracy_after"]
    return sorted(points.items())
