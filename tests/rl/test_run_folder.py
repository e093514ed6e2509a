"""Resuming and the save folder, end to end (issue 37): a cut, garbage or NaN latest checkpoint gives way to the
previous intact one with a line; --resume step-N moves the later checkpoints aside; a refused --save-path prints no
summary and creates nothing; a preset replaces only its own run; a run without --save-path has its own folder."""

import json
import logging
import shutil
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from areno import presets
from areno.config import TrainConfig
from areno.training.checkpoint import latest_checkpoint
from tests.rl.test_run_safety import args, files, metrics, reward_file, run  # noqa: F401 - files is a fixture

REWARD = "def reward_fn(record):\n    return float(len(record.completion) % 2)\n"


@pytest.fixture(scope="module")
def base(files, tmp_path_factory):  # noqa: F811
    """One 2-step run saving every step (step-1, step-2 and metrics rows 1, 2), on training rows only (no held-out
    evaluation: faster); ``argv(out, *extra, steps=N)`` runs the same run in another folder."""
    root = tmp_path_factory.mktemp("base")
    reward = reward_file(root, REWARD)
    rows = [json.loads(x) for x in files[1].read_text().splitlines() if "split" not in json.loads(x)]
    train_only = root / "train.jsonl"
    train_only.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def argv(out, *extra, steps):
        a = args(files, reward, out, "--save-interval", "1", *extra, steps=steps)
        a[a.index("--dataset-path") + 1] = str(train_only)
        return a

    from areno.cli import main

    out = root / "out"
    assert main(argv(out, steps=2)) == 0
    return out, argv


@pytest.fixture
def stub_runner(monkeypatch):
    seen = {}

    def runner(config):
        print("train runner started")
        seen["config"] = config
        return 0

    monkeypatch.setitem(sys.modules, "areno.rl.runner", types.SimpleNamespace(run_train=runner))
    return seen


def copy(base, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(base[0], out, symlinks=True)
    return out


def nan_weights(folder, value=float("nan")) -> str:
    tensors = load_file(str(folder / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return name.removeprefix("model.")


@pytest.mark.parametrize("fault", ["cut weights", "garbage optimizer", "nan weights"])
def test_a_broken_latest_checkpoint_gives_way_to_the_previous_intact_one(base, tmp_path, capsys, caplog, fault):
    out = copy(base, tmp_path)
    if fault == "cut weights":  # a full disk or a kill
        weights = out / "step-2" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        why = "CheckpointError"  # the loader names the cut file
    elif fault == "garbage optimizer":
        (out / "step-2" / "training_state" / "optimizer-rank0.pt").write_bytes(b"\x00garbage" * 100)
        why = "Error"
    else:
        why = f"ValueError: its weights hold NaN or inf ({nan_weights(out / 'step-2')}"
    caplog.set_level(logging.WARNING, "areno.train")
    code, _, err = run(capsys, base[1](out, "--resume", steps=2))
    assert code == 0 and "Traceback" not in err, err
    assert f"cannot resume from {out / 'step-2'}: " in caplog.text and why in caplog.text
    assert f"resuming from {out / 'step-1'}, the latest intact checkpoint" in caplog.text
    retired = list(out.glob("retired-after-step-1-*"))  # the refused one kept aside, never picked up again
    assert len(retired) == 1 and sorted(p.name for p in retired[0].glob("step-*")) == ["step-2"]
    assert sorted(p.name for p in out.glob("step-*")) == ["step-1", "step-2"]  # step 2 redone
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "step-2" / "model.safetensors")).values())
    assert [m["step"] for m in metrics(out) if "loss" in m] == [1, 2]


def test_resuming_a_nan_checkpoint_by_name_is_refused_in_one_line(base, tmp_path, capsys):
    out = copy(base, tmp_path)
    nan_weights(out / "step-1", float("inf"))
    code, _, err = run(capsys, base[1](out, "--resume", str(out / "step-1"), steps=2))
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err
    assert "--resume found no intact checkpoint to resume from" in lines[-1] and "NaN or inf" in lines[-1]
    assert (out / "step-2" / "COMPLETE").is_file()  # nothing moved: the run did not start


def test_resume_from_an_earlier_step_retires_the_later_checkpoints_and_rows(base, tmp_path, capsys, caplog):
    out = copy(base, tmp_path)
    caplog.set_level(logging.WARNING, "areno.train")
    code, _, err = run(capsys, base[1](out, "--resume", "step-1", steps=1))  # a bare name: in --save-path
    assert code == 0, err
    retired = list(out.glob("retired-after-step-1-*"))
    assert len(retired) == 1 and sorted(p.name for p in retired[0].iterdir()) == ["metrics.jsonl", "step-2"]
    assert "resuming from step 1: moved step-2 and " in caplog.text and str(retired[0]) in caplog.text
    assert {json.loads(x)["step"] for x in (retired[0] / "metrics.jsonl").read_text().splitlines()} == {2}
    assert sorted(p.name for p in out.glob("step-*")) == ["step-1"]
    assert [m["step"] for m in metrics(out)] == [m["step"] for m in metrics(base[0]) if m["step"] <= 1]
    assert latest_checkpoint(out) == out / "step-1"  # the next plain --resume continues this run, not step 2


def test_a_refused_save_path_prints_no_summary_and_creates_nothing(base, tmp_path, capsys, stub_runner):
    out = copy(base, tmp_path)
    (out / ".areno.lock").unlink()
    code, stdout, err = run(capsys, base[1](out, steps=1))
    assert code == 2 and "already holds an earlier run (metrics, step-1, step-2)" in err
    assert "another run's files" not in err and "areno train:" not in stdout and "config" not in stub_runner
    assert not (out / ".areno.lock").exists()
    code, stdout, _ = run(capsys, base[1](tmp_path / "new", steps=1))
    assert code == 0 and f"checkpoints go to {tmp_path / 'new'}; the resolved configuration goes to" in stdout


def test_a_preset_with_overwrite_replaces_only_its_own_run(files, base, tmp_path, capsys, monkeypatch,  # noqa: F811
                                                           stub_runner):
    ckpt, data, _ = files
    out = copy(base, tmp_path)
    reward = reward_file(tmp_path, REWARD)

    def unit_preset():
        return TrainConfig(preset="unit", ckpt=str(ckpt), dataset_path=str(data), reward_fn_path=str(reward),
                           save_path=str(out), overwrite=True)

    monkeypatch.setitem(presets.PRESETS, "unit", unit_preset)
    code, _, err = run(capsys, ["train", "--preset", "unit"])
    assert code == 2 and "holds files the unit preset did not write" in err and "pass --overwrite" in err
    assert "config" not in stub_runner and (out / "step-2" / "COMPLETE").is_file()
    assert run(capsys, ["train", "--preset", "unit", "--overwrite"])[0] == 0  # explicit: the user's choice
    (out / ".areno-run.json").write_text(json.dumps({"preset": "unit"}))  # what the preset's own run records
    assert run(capsys, ["train", "--preset", "unit"])[0] == 0
    assert stub_runner["config"].overwrite


def test_a_run_without_a_save_path_gets_its_own_metrics_folder(base, tmp_path, capsys, monkeypatch, stub_runner):
    monkeypatch.chdir(tmp_path)
    argv = base[1]("x", steps=1)
    for flag in ("--save-path", "--save-interval"):  # --save-interval applies only with --save-path
        i = argv.index(flag)
        del argv[i : i + 2]
    code, stdout, _ = run(capsys, argv)
    folder = stub_runner["config"].metrics_dir
    assert code == 0 and folder.startswith("runs/") and folder != "runs/latest"
    assert f"the resolved configuration goes to {folder}/config.json" in stdout
