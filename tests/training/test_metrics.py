"""Metrics: JSON lines content, TensorBoard events, the stdout line, rank != 0 silence, the reward-curve PNG."""

import json
import math
import sys

import pytest
import torch

from areno.training.metrics import (
    MetricsLogger,
    format_line,
    plot_reward_curve,
    read_metrics,
    reward_band,
    reward_curve_figure,
)

STEP = {"reward_mean": 0.41, "reward_std": 0.22, "loss": 0.0123, "kl": 1.5e-4, "logprob_diff": 3.1e-3,
        "grad_norm": 0.52, "lr": 1e-6, "rollout_tok_s": 1234.4, "train_tok_s": 567.8, "step_s": 3.21}


def test_jsonl_lines_and_stdout(tmp_path, capsys):
    with MetricsLogger(tmp_path / "m", tensorboard=False) as logger:
        logger.log(1, dict(STEP, zero_variance_groups=3, eval_accuracy=torch.tensor(0.5), note="x"))
        logger.log(2, {"reward_mean": math.nan, "loss": math.inf, "count": 7})
    lines = (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(x) for x in lines)
    assert first["step"] == 1 and isinstance(first["time"], float)
    assert first["reward_mean"] == 0.41 and first["eval_accuracy"] == 0.5 and first["note"] == "x"
    assert isinstance(first["zero_variance_groups"], float)
    assert second == {"step": 2, "time": second["time"], "reward_mean": None, "loss": None, "count": 7.0}
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("step 1 | reward 0.410±0.220 | eval 0.500 | loss 0.0123 | kl 0.00015 | lp_diff 0.0031 | "
                      "gnorm 0.52 | lr 1.00e-06 | zero_var 3 | rollout 1234 tok/s | train 568 tok/s | 3.2s")
    assert out[1] == "step 2"  # null values are left out of the line


def test_appends_across_loggers(tmp_path):
    for step in (1, 2):
        logger = MetricsLogger(tmp_path, tensorboard=False, stdout=False)
        logger.log(step, {"loss": float(step)})
        logger.close()
        logger.close()  # idempotent
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 2.0]


def test_format_line_shows_only_present_keys():
    assert format_line(3, {"loss": 1.5, "step_s": 0.25}) == "step 3 | loss 1.5 | 0.2s"
    assert format_line(4, {"reward_mean": 1.0}) == "step 4 | reward 1.000"
    assert "nll 2.5" in format_line(5, {"nll": 2.5, "clip_frac": 0.1, "entropy": 0.9})


def test_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, stdout=False) as logger:
        logger.log(1, {"reward_mean": 0.25, "loss": 2.0})
        logger.log(2, {"reward_mean": 0.75, "note": "x"})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert "note" not in acc.Tags()["scalars"]


def test_missing_tensorboard_warns_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with MetricsLogger(tmp_path, stdout=False) as logger:
        logger.log(1, {"loss": 1.0})
        logger.log(2, {"loss": 2.0})
    warnings = [r for r in caplog.records if r.name == "areno.metrics"]
    assert len(warnings) == 1 and "TensorBoard" in warnings[0].getMessage()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2 and not (tmp_path / "tb").exists()


def test_other_ranks_write_nothing(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "m", rank=1)
    logger.log(1, STEP)
    logger.close()
    assert not (tmp_path / "m").exists() and capsys.readouterr().out == ""


def test_reward_curve_png(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, stdout=False) as logger:
        for step in range(1, 31):
            logger.log(step, {"reward_mean": step / 30, "reward_std": 0.1, "loss": 1.0})
    png = plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "reward.png", title="toy")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="no 'eval_accuracy' values"):
        plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "e.png", key="eval_accuracy")


def _band_of(fig):
    """The y extent of the ±std band (the one PolyCollection fill_between draws) of a reward-curve figure."""
    from matplotlib.collections import PolyCollection

    (band,) = [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]
    ys = [y for path in band.get_paths() for _, y in path.vertices]
    return min(ys), max(ys)


def test_reward_band_stays_within_the_observed_rewards(tmp_path):
    # 0/1 rewards, 8 samples a step: mean + std passes 1 (0.875 + 0.354) and mean - std falls below 0 (0.125 - 0.354)
    means = [0.125, 0.5, 0.875, 0.875, 1.0]
    with MetricsLogger(tmp_path, tensorboard=False, stdout=False) as logger:
        for step, m in enumerate(means, 1):
            std = (m * (1 - m) * 8 / 7) ** 0.5
            logger.log(step, {"reward_mean": m, "reward_std": std})
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps, lower, upper = reward_band(records)
    assert steps == [1, 2, 3, 4, 5]
    assert max(upper) <= 1.0 and min(lower) >= 0.125  # no per-step extremes logged: the run's observed range
    assert upper[0] == pytest.approx(0.125 + (0.125 * 0.875 * 8 / 7) ** 0.5)  # inside the range: unchanged
    assert lower[1] == pytest.approx(0.125) and upper[1] == upper[2] == 1.0
    assert all(lo <= m <= hi for lo, m, hi in zip(lower, means, upper))
    assert _band_of(reward_curve_figure(records)) == (pytest.approx(0.125), pytest.approx(1.0))
    assert plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_reward_band_uses_logged_per_step_extremes():
    records = [{"step": 1, "reward_mean": 0.5, "reward_std": 0.6, "reward_min": 0.0, "reward_max": 1.0},
               {"step": 2, "reward_mean": 0.9, "reward_std": 0.3, "reward_min": 0.5, "reward_max": 1.0},
               {"step": 3, "reward_mean": -0.2, "reward_std": 0.1, "reward_min": -1.0, "reward_max": 0.0}]
    steps, lower, upper = reward_band(records)
    assert lower == pytest.approx([0.0, 0.6, -0.3]) and upper == pytest.approx([1.0, 1.0, -0.1])
    assert _band_of(reward_curve_figure(records)) == (pytest.approx(-0.3), pytest.approx(1.0))
    assert reward_band([{"step": 1, "reward_mean": 0.5}]) is None  # no std logged: no band


def test_a_cut_last_line_is_dropped_with_a_warning_on_resume_and_when_read(tmp_path, caplog):
    folder = tmp_path / "m"
    with MetricsLogger(folder, tensorboard=False, stdout=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"loss": 0.5})
    path = folder / "metrics.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"step": 4, "loss": 0.')  # a disk that filled mid-line
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert "dropped 1 line that is not" in caplog.text and "line 4" in caplog.text
    with MetricsLogger(folder, tensorboard=False, stdout=False) as logger:  # the resume: no JSONDecodeError
        assert "dropped its last line, cut short at 22 bytes" in caplog.text
        logger.truncate_after(2)
        logger.log(3, {"loss": 0.25})
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 0.5), (2, 0.5), (3, 0.25)]


def test_a_metrics_write_the_disk_cannot_take_leaves_only_whole_lines(tmp_path, caplog):
    import errno

    folder = tmp_path / "m"
    logger = MetricsLogger(folder, tensorboard=False, stdout=False)
    logger.log(1, {"loss": 0.5})
    real = logger._file

    class Full:  # writes half the line, then the disk is full
        name = real.name

        def seek(self, *a):
            return real.seek(*a)

        def write(self, data):
            real.write(data[: len(data) // 2])
            real.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            real.close()

    logger._file = Full()
    logger.log(2, {"loss": 0.25, "note": "x" * 100})
    assert "could not write step 2's metrics line" in caplog.text and "No space left" in caplog.text
    logger.log(3, {"loss": 0.125})  # the disk has room again
    logger.close()
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 3]
