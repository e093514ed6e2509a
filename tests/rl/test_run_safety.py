"""Nothing lost, nothing silent (issue 16): user code that exits or hangs costs samples, not the run; a run whose
rewards all fail stops with exit 1 after saving; one run per save folder; no mixing with another run's files; an
unwritable folder fails before the first step; --resume after a kill continues exactly; bad inputs are one line."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areno.cli import main
from areno.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    ckpt = make_tiny_checkpoint(root / "ckpt", family="qwen3", seed=0)
    rng = random.Random(0)
    rows = []
    for i in range(40):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b),
                     **({"split": "test"} if i >= 32 else {})})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpt, data, root


def reward_file(folder: Path, body: str) -> Path:
    path = folder / f"reward_{abs(hash(body))}.py"
    path.write_text("import os, sys, time, signal\n" + body)
    return path


def args(files, reward, out, *extra, steps=3):
    ckpt, data, _ = files
    return ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward),
            "--batch-size", "4", "--n-samples", "2", "--mini-bs", "2", "--max-steps", str(steps), "--max-new-tokens",
            "6", "--save-path", str(out), "--lr", "1e-3", "--no-tensorboard", "--dtype", "float32", *extra]


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]


def run(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# ---- user code ---------------------------------------------------------------------------------------------------
def test_sys_exit_and_a_hang_in_the_reward_cost_samples_and_the_run_finishes_and_saves(files, tmp_path, capsys):
    reward = reward_file(tmp_path, "calls = [0]\n"
                         "def reward_fn(record):\n"
                         "    calls[0] += 1\n"
                         "    if calls[0] == 17:\n"
                         "        sys.exit(0)\n"
                         "    if calls[0] == 18:\n"
                         "        time.sleep(3600)\n"
                         "    return float(len(record.completion) % 2)\n")
    out = tmp_path / "out"
    t0 = time.monotonic()
    code, _, _ = run(capsys, args(files, reward, out, "--reward-timeout-s", "1"))
    assert code == 0 and time.monotonic() - t0 < 120
    assert (out / "step-3" / "COMPLETE").is_file()
    failures = [m["reward_failures"] for m in metrics(out) if "reward_failures" in m]
    assert failures[:3] == [0.0, 2.0, 0.0]  # after 8 held-out calls and step 1: step 2 has the exit and the hang


def test_a_run_whose_rewards_all_fail_stops_with_exit_1_and_saves(files, tmp_path, capsys):
    reward = reward_file(tmp_path, "def reward_fn(record):\n    raise ValueError('broken reward')\n")
    out = tmp_path / "out"
    code, _, err = run(capsys, args(files, reward, out, "--max-reward-failure-steps", "2", steps=6))
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert "every reward failed in the last 2 steps (steps 1-2)" in last and str(reward) in last
    assert f"saved at {out / 'step-2'}" in last
    assert (out / "step-2" / "COMPLETE").is_file() and not (out / "step-3").exists()


# ---- the save folder -----------------------------------------------------------------------------------------------
HOLD = """
import sys, time
from areno.training.run_dir import claim
claim(sys.argv[1], resume=False, overwrite=False)
print("HELD", flush=True)
time.sleep(120)
"""


def test_a_folder_held_by_a_live_run_is_refused_naming_its_pid(files, tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        reward = reward_file(tmp_path, "def reward_fn(record):\n    return 1.0\n")
        code, _, err = run(capsys, args(files, reward, out, steps=1))
        assert code == 2 and f"is in use by another areno run: PID {holder.pid}" in err
        assert not (out / "metrics").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (killed, so it released nothing itself): the kernel dropped its lock
    code, _, _ = run(capsys, args(files, reward, out, steps=1))
    assert code == 0 and (out / "step-1" / "COMPLETE").is_file()


def test_a_folder_with_another_runs_files_needs_resume_or_overwrite(files, tmp_path, capsys):
    reward = reward_file(tmp_path, "def reward_fn(record):\n    return float(len(record.completion) % 2)\n")
    out = tmp_path / "out"
    assert run(capsys, args(files, reward, out, "--save-interval", "1", steps=3))[0] == 0
    code, _, err = run(capsys, args(files, reward, out, steps=1))
    assert code == 2 and "already holds an earlier run" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["metrics", "step-1", "step-2",
                                                                                   "step-3"]
    code, _, _ = run(capsys, args(files, reward, out, "--overwrite", steps=1))
    assert code == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["metrics", "step-1"]
    assert [m["step"] for m in metrics(out) if "loss" in m] == [1]


def test_an_unwritable_save_path_fails_before_the_first_step(files, tmp_path, capsys):
    reward = reward_file(tmp_path, "def reward_fn(record):\n    return 1.0\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, out, err = run(capsys, args(files, reward, blocker / "run"))
    assert code == 2 and f"--save-path {blocker / 'run'} is not writable" in err
    assert "step 1" not in out and len(err.strip().splitlines()) == 1


# ---- exact resume after a kill -----------------------------------------------------------------------------------
KILLING_REWARD = """calls = [0]
def reward_fn(record):
    calls[0] += 1
    if os.environ.get("KILL_AT_CALL") and calls[0] == int(os.environ["KILL_AT_CALL"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return float(len(record.completion) % 3 == 0) + 0.1 * (record.completion.count("1"))
"""


def test_resume_after_a_kill_reproduces_the_next_three_steps_exactly(files, tmp_path, capsys):
    reward = reward_file(tmp_path, KILLING_REWARD)
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--save-interval", "1", "--temperature", "1.0"]

    def areno(out, *extra, **env):  # every run in a fresh process with the same threads: bitwise comparable
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
        return subprocess.run([sys.executable, "-m", "areno", *args(files, reward, out, *common, *extra, steps=6)],
                              env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)

    proc = areno(full)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same run killed (SIGKILL, from inside its reward function) during step 4's scoring, after step-3's save;
    # 8 held-out prompts are scored first, then 8 samples a step
    proc = areno(part, KILL_AT_CALL=str(8 + 3 * 8 + 1))
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert sorted(p.name for p in part.glob("step-*")) == ["step-1", "step-2", "step-3"]
    proc = areno(part, "--resume")
    assert proc.returncode == 0 and "measured before the run was interrupted" in proc.stdout, proc.stderr[-3000:]

    a, b = metrics(full), metrics(part)
    assert [m["step"] for m in b] == [m["step"] for m in a]  # no duplicate lines from the killed run
    for key in ("loss", "reward_mean", "reward_std", "grad_norm", "eval_accuracy_before", "eval_accuracy_after"):
        assert [m.get(key) for m in b] == [m.get(key) for m in a], key
    assert any(m.get("loss") for m in a if m["step"] > 3)
    for n in (4, 5, 6):
        x, y = (load_file(str(r / f"step-{n}" / "model.safetensors")) for r in (full, part))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# ---- one-line errors for bad inputs ------------------------------------------------------------------------------
def test_missing_model_or_checkpoint_is_one_line_exit_2(files, tmp_path, capsys):
    ckpt, data, _ = files
    reward = reward_file(tmp_path, "def reward_fn(record):\n    return 1.0\n")
    base = ["--dataset-path", str(data), "--reward-fn-path", str(reward)]
    cases = [
        (["train", "--ckpt", str(tmp_path / "nope"), *base], "--ckpt"),
        (["train", "--ckpt", str(tmp_path), *base], "without config.json"),
        (["train", "--ckpt", "no-such-org/no-such-model", *base], "--ckpt could not resolve model"),
        (["serve", "--model-path", str(tmp_path / "nope")], "--model-path"),
        (["train", "--ckpt", str(ckpt), *base, "--ref-ckpt", str(tmp_path / "nope")], "--ref-ckpt"),
    ]
    for argv, expected in cases:
        code, _, err = run(capsys, argv)
        lines = [x for x in err.strip().splitlines() if not x.startswith("usage:")]
        assert code == 2 and len(lines) == 1 and expected in lines[0], (argv, err)
        assert "Traceback" not in err


def test_resume_with_nothing_to_resume_names_the_folder(files, tmp_path, capsys):
    reward = reward_file(tmp_path, "def reward_fn(record):\n    return 1.0\n")
    out = tmp_path / "empty"
    code, _, err = run(capsys, args(files, reward, out, "--resume"))
    assert code == 2 and f"--resume found no complete checkpoint (a step-N folder with its COMPLETE marker) in {out}" \
        in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, args(files, reward, tmp_path / "o2", "--resume", str(tmp_path / "missing")))
    assert code == 2 and f"--resume {tmp_path / 'missing'} does not exist" in err


def test_a_loader_that_raises_and_a_reward_with_a_syntax_error_are_one_line(files, tmp_path, capsys):
    ckpt, data, _ = files
    loader = tmp_path / "loader.py"
    loader.write_text("def load_training_dataset(path, *, default_loader, **kwargs):\n"
                      "    raise RuntimeError('the bucket is gone')\n")
    good = reward_file(tmp_path, "def reward_fn(record):\n    return 1.0\n")
    code, _, err = run(capsys, ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--dataset-loader-fn",
                                str(loader), "--reward-fn-path", str(good)])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--dataset-loader-fn" in lines[0] and "the bucket is gone" in lines[0]
    assert "line 2" in lines[0]
    bad = tmp_path / "bad.py"
    bad.write_text("def reward_fn(record):\n    return (1.0\n")
    code, _, err = run(capsys, ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path",
                                str(bad)])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--reward-fn-path" in lines[0]
    assert lines[0].count("line 2") == 1, lines[0]  # the line number once, not repeated


def test_the_configuration_goes_to_the_run_folder_and_errors_come_last(files, tmp_path, capsys):
    reward = reward_file(tmp_path, "def reward_fn(record):\n    return 1.0\n")
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, args(files, reward, out, steps=1))
    assert code == 0 and "resolved configuration\n" not in stdout
    saved = json.loads((out / "metrics" / "config.json").read_text())
    assert saved["max_steps"] == 1 and saved["save_path"] == str(out)
    assert len([x for x in stdout.splitlines() if x.startswith("areno train:")]) == 1


def test_help_lists_the_presets(capsys):
    code, out, _ = run(capsys, ["train", "--help"])
    text = " ".join(out.split())
    assert code == 0 and "presets: agentic-quickstart, quickstart" in text


def test_a_gsm8k_like_run_without_held_out_rows_says_why_and_still_draws_the_reward_curve(files, tmp_path, capsys):
    ckpt, data, _ = files
    rows = [json.loads(x) for x in data.read_text().splitlines() if "split" not in json.loads(x)]
    train_only = tmp_path / "train.jsonl"
    train_only.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = reward_file(tmp_path, "def reward_fn(record):\n    return float(len(record.completion) % 2)\n")
    out = tmp_path / "out"
    argv = args(files, reward, out, steps=2)
    argv[argv.index("--dataset-path") + 1] = str(train_only)
    code, stdout, _ = run(capsys, argv)
    assert code == 0
    assert "held-out accuracy: not measured: the dataset has no held-out rows" in stdout
    assert (out / "metrics" / "reward_curve.png").is_file()


def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_previous_checkpoint(files, tmp_path, capsys,
                                                                                   monkeypatch):
    import shutil
    from collections import namedtuple

    from areno.training.checkpoint import load_checkpoint

    reward = reward_file(tmp_path, "def reward_fn(record):\n    return float(len(record.completion) % 2)\n")
    out = tmp_path / "out"
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    saves = []

    def filling_up(path):  # room for the first checkpoint, then the disk is full
        saves.append(path)
        return real(path) if len(saves) == 1 else usage(10**12, 10**12 - 4096, 4096)

    monkeypatch.setattr(shutil, "disk_usage", filling_up)
    code, _, err = run(capsys, args(files, reward, out, "--save-interval", "1", steps=3))
    lines = err.strip().splitlines()
    assert code == 1 and "Traceback" not in err
    assert f"not enough disk space to save checkpoint {out / 'step-2'}: it needs about" in lines[-1]
    assert "has 4096 bytes free" in lines[-1]
    assert sorted(p.name for p in out.glob("step-*")) == ["step-1"]
    assert load_checkpoint(out / "step-1", rng=False)["step"] == 1
