"""Per-step metrics: JSON lines, TensorBoard scalars and a compact stdout line; a reward-curve plot.

Only rank 0 writes anything. ``metrics.jsonl`` gets one object per logged step, ``{"step", "time", ...}`` with float
values (non-finite ones as null); TensorBoard events go to ``<metrics_dir>/tb``; the stdout line goes through
``tqdm.write`` so it sits above the progress bar instead of breaking it.
"""

from __future__ import annotations

import json
import logging
import math
import os
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
    ("spec_accept_len", "accept", "{:.2f}"),
    ("spec_gated_steps", "gated", "{:.0f}"),
    ("spec_limit", "spec_N", "{:.0f}"),
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
        self.wandb = None  # a WandbRun (--wandb-project): every line logged goes there too
        if self.active:
            self.metrics_dir.mkdir(parents=True, exist_ok=True)
            _end_whole(self.jsonl_path)
            self._file = open(self.jsonl_path, "ab")
            self._write_failed = False

    @property
    def jsonl_path(self) -> Path:
        return self.metrics_dir / "metrics.jsonl"

    def log(self, step: int, metrics: dict, *, stdout: bool = True) -> None:
        """One JSON line (and TensorBoard scalars); also a compact stdout line unless ``stdout`` is False."""
        if not self.active or self._file is None:
            return
        clean = {k: _clean(v) for k, v in metrics.items() if k not in ("step", "time")}
        self._append(int(step), (json.dumps({"step": int(step), "time": time.time(), **clean}, allow_nan=False)
                                 + "\n").encode())
        writer = self._tb()
        if writer is not None:
            for k, v in clean.items():
                if isinstance(v, float):
                    writer.add_scalar(k, v, int(step))
            writer.flush()
        if self.wandb is not None:
            self.wandb.log(int(step), {k: v for k, v in clean.items() if isinstance(v, float)})
        if self.stdout and stdout:
            from tqdm import tqdm

            tqdm.write(format_line(int(step), {k: v for k, v in clean.items() if isinstance(v, float)}))

    def truncate_after(self, step: int) -> int:
        """Forget what was logged after ``step`` (a resumed run redoes those steps): metrics.jsonl keeps its lines
        up to ``step`` (rewritten atomically) and TensorBoard purges the later events on its next write. Returns
        how many steps past ``step`` had been logged (the steps the resumed run repeats; 0 off the main rank)."""
        if not self.active or self._file is None:
            return 0
        self._file.close()
        path = self.jsonl_path
        lines = read_lines(path)
        keep = [line for line, rec in lines if rec.get("step", 0) <= step]
        repeated = len({rec.get("step") for _, rec in lines if rec.get("step", 0) > step})
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep), encoding="utf-8")
        tmp.replace(path)
        self._file = open(path, "ab")
        self._purge_step = step + 1
        return repeated

    def _append(self, step: int, line: bytes) -> None:
        """Write one whole line or none: a write the disk cannot take (full, quota) is cut back to the last whole
        line and reported once; the run goes on (its checkpoint save reports a full disk on its own terms)."""
        end = self._file.seek(0, 2)
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            try:
                self._file = _reopen_cut(self._file, end)
            except OSError:
                pass
            if not self._write_failed:
                log.warning("could not write step %d's metrics line to %s (%s): the file keeps its whole lines up "
                            "to there; later lines are tried again", step, self.jsonl_path, e.strerror or e)
            self._write_failed = True

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
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
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


def _end_whole(path: Path) -> None:
    """Cut a last line left unfinished (a kill or a full disk mid-write) off ``path``, with a warning, so the next
    line appended starts a line of its own."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0 or (f.seek(size - 1), f.read(1))[1] == b"\n":
                return
            f.seek(0)
            keep = f.read().rfind(b"\n") + 1
    except FileNotFoundError:
        return
    os.truncate(path, keep)
    log.warning("%s: dropped its last line, cut short at %d bytes by a kill or a full disk", path, size - keep)


def _reopen_cut(f, end: int):
    """``f`` (binary, append) cut back to ``end`` bytes; the buffered part of a failed write is dropped, not
    retried at the next flush."""
    name = f.name
    try:
        f.close()
    except OSError:
        pass  # closing flushes the failed buffer again: it fails again and is discarded
    os.truncate(name, end)
    return open(name, "ab")


def read_lines(jsonl_path) -> list[tuple[str, dict]]:
    """The (line, record) pairs of a metrics.jsonl. A line that is not a JSON object (a write cut by a full disk or
    a kill) is dropped with a warning naming the file and line, so a resume or a plot never fails on it."""
    out, bad = [], []
    with open(jsonl_path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                out.append((line if line.endswith("\n") else line + "\n", rec))
            else:
                bad.append(n)
    if bad:
        log.warning("%s: dropped %d line%s that %s not whole JSON records (line %s; a write cut short by a full "
                    "disk or a kill)", jsonl_path, len(bad), "s" * (len(bad) > 1), "are" if len(bad) > 1 else "is",
                    ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else ""))
    return out


def read_metrics(jsonl_path) -> list[dict]:
    return [rec for _, rec in read_lines(jsonl_path)]


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
    sets = eval_series(everything)
    fig = Figure(figsize=(7, 4.6 + 2.6 * len(sets)), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax, *panels = fig.subplots(1 + len(sets), 1, squeeze=False)[:, 0]
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
    for panel, (name, series) in zip(panels, sets.items()):
        eval_panel(panel, name, series)
    # below the axes, off the data (the reward panel's; each evaluation panel has its own)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=2, frameon=False, fontsize=9)
    return fig


def eval_series(records: list[dict]) -> dict[str, dict[str, list[tuple]]]:
    """The --eval-dataset-path metrics a run logged: {set: {metric: [(step, value, low, high), ...]}} for avg@K,
    the largest pass@k and maj@K (keys ``eval/<set>/<metric>`` with ``_lo`` / ``_hi`` bounds)."""
    sets: dict[str, dict[str, list[tuple]]] = {}
    for r in sorted(records, key=lambda r: r["step"]):
        for k, v in r.items():
            if not k.startswith("eval/") or k.endswith(("_lo", "_hi", "/policy_version")) or v is None:
                continue
            _, name, metric = k.split("/", 2)
            sets.setdefault(name, {}).setdefault(metric, []).append((r["step"], v, r.get(k + "_lo", v),
                                                                     r.get(k + "_hi", v)))
    for series in sets.values():
        passes = sorted((m for m in series if m.startswith("pass@")), key=lambda m: int(m[5:]))
        for m in passes[:-1]:
            del series[m]
    return sets


def eval_panel(ax, name: str, series: dict[str, list[tuple]]) -> None:
    """One evaluation set over steps: each metric's line and its 95% interval band."""
    for i, (metric, points) in enumerate(sorted(series.items())):
        steps, values, low, high = zip(*points)
        ax.plot(steps, values, marker="o", lw=1.5, color=f"C{i}", label=metric)
        ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.15)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_title(f"{name} (bands: bootstrap 95% intervals)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


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
