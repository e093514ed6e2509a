"""The reward-curve plot: it shows the held-out accuracy the run prints as its headline (before RL, each evaluation,
after RL), its legend sits off the data, and drawing it adds no matplotlib INFO line to the run's output."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areno.training import metrics
from areno.training.metrics import MetricsLogger, read_metrics, reward_curve_figure

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the train extra: bash scripts/install.sh)")


def _quickstart_like_metrics(folder):
    """40 RL steps, an evaluation every 10, the before/after record fit() logs at the end."""
    with MetricsLogger(folder, tensorboard=False, stdout=False) as logger:
        for step in range(1, 41):
            m = {"reward_mean": min(1.0, 0.3 + step / 50), "reward_std": 0.4, "reward_min": 0.0, "reward_max": 1.0}
            if step % 10 == 0:
                m["eval_accuracy"] = 0.7 + step / 200
            logger.log(step, m)
        logger.log(40, {"eval_accuracy_before": 0.685, "eval_accuracy_after": 0.9})
    return read_metrics(folder / "metrics.jsonl")


def test_the_held_out_accuracy_is_on_the_curve(tmp_path):
    records = _quickstart_like_metrics(tmp_path)
    points = metrics.eval_points(records)
    assert [x for x, _ in points] == [0, 10, 20, 30, 40]
    assert [y for _, y in points] == pytest.approx([0.685, 0.75, 0.8, 0.85, 0.9])
    fig = reward_curve_figure(records)
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "held-out accuracy (greedy)"]
    assert list(line.get_xdata()) == [0, 10, 20, 30, 40]
    assert list(line.get_ydata()) == pytest.approx([0.685, 0.75, 0.8, 0.85, 0.9])
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "68.5%" in texts and "90.0%" in texts  # the headline's before and after figures
    assert metrics.eval_points([{"step": 3, "reward_mean": 0.5}]) == []  # no held-out rows: no points, no line


def test_the_legend_stays_off_the_data(tmp_path):
    fig = reward_curve_figure(_quickstart_like_metrics(tmp_path))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = fig.legends + [a.get_legend() for a in fig.axes if a.get_legend() is not None]
    assert len(legends) == 1
    box, plot = legends[0].get_window_extent(renderer), fig.axes[0].get_window_extent(renderer)
    assert box.y1 <= plot.y0 or box.x0 >= plot.x1, (box, plot)  # below or beside the axes, never over them
    assert 0 <= box.x0 and box.x1 <= fig.bbox.x1 and 0 <= box.y0  # and inside the image


def test_drawing_prints_no_matplotlib_info_line(tmp_path):
    """A run logs at INFO; matplotlib's first use builds its font cache and logs "generated new fontManager"."""
    _quickstart_like_metrics(tmp_path)
    script = ("import logging, sys; logging.basicConfig(level=logging.INFO)\n"
              "from areno.training.metrics import plot_reward_curve\n"
              "plot_reward_curve(sys.argv[1], sys.argv[2])\n")
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl"),  # a fresh font cache, as on a new machine
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "metrics.jsonl"), str(tmp_path / "r.png")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "mpl").exists() and (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert "matplotlib" not in proc.stderr and "fontManager" not in proc.stderr, proc.stderr
