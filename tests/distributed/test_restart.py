"""--max-restarts: SIGKILL one rank of a two-rank (gloo) run mid-run; torch's elastic agent restarts the ranks, they
resume from the last complete checkpoint, the run finishes with the uninterrupted run's weights, and metrics.jsonl
holds each step once, the first step after the restart saying how many steps were repeated."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areno.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                reason="needs 2 GPUs on a CUDA host")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    ckpt = make_tiny_checkpoint(root / "ckpt", family="qwen3", seed=0)
    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(32))]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = root / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record.completion) % 3 == 0)\n")
    return ckpt, data, reward


def start(files, out, *extra):
    ckpt, data, reward = files
    argv = ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward),
            "--world-size", "2", "--batch-size", "4", "--n-samples", "2", "--mini-bs", "2", "--max-steps",
            str(STEPS), "--max-new-tokens", "4", "--save-path", str(out), "--save-interval", "3", "--lr", "1e-3",
            "--no-tensorboard", "--dtype", "float32", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "areno", *argv], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def steps_logged(out) -> list[dict]:
    path = out / "metrics" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def rank_pid(parent: int, rank: int) -> int | None:
    """The first-try worker process of ``rank`` below ``parent`` (found by its environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and any(e.startswith(b"ARENO_TRAIN_CONFIG=") for e in environ) \
                and b"TORCHELASTIC_RESTART_COUNT=0" in environ and f"ARENO_TEST_PARENT={parent}".encode() in environ:
            return int(pid)
    return None


def test_a_killed_rank_restarts_and_resumes_exactly(files, tmp_path):
    whole = start(files, tmp_path / "whole")
    out = tmp_path / "restarted"
    os.environ["ARENO_TEST_PARENT"] = marker = str(os.getpid())
    try:
        proc = start(files, out, "--max-restarts", "1")
    finally:
        os.environ.pop("ARENO_TEST_PARENT")
    deadline = time.monotonic() + 240
    while not any(m["step"] >= 4 for m in steps_logged(out)):  # past the checkpoint at step 3
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    victim = rank_pid(int(marker), 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    logged_before = max(m["step"] for m in steps_logged(out))
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 0, err[-4000:]
    assert whole.wait(timeout=300) == 0, whole.communicate()[1][-3000:]
    ms = steps_logged(out)
    assert [m["step"] for m in ms] == list(range(1, STEPS + 1))  # every step once
    resumed = [m for m in ms if "repeated_steps" in m]
    assert len(resumed) == 1 and resumed[0]["restarts"] == 1, resumed
    assert resumed[0]["step"] == 4  # resumed from step-3 (--save-interval 3), then redid step 4 first
    assert resumed[0]["repeated_steps"] >= logged_before - 3 >= 1
    a = load_file(str(tmp_path / "whole" / f"step-{STEPS}" / "model.safetensors"))
    b = load_file(str(out / f"step-{STEPS}" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for x, y in zip(steps_logged(tmp_path / "whole"), ms):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6), (x, y)


def test_save_interval_minutes_saves_at_the_next_step_boundary(files, tmp_path):
    """--save-interval-minutes (here a few milliseconds): every step boundary past the interval saves, without
    --save-interval; the run's end adds no second save of the last step."""
    from areno.config import TrainConfig
    from areno.rl.runner import train

    ckpt, data, reward = files
    run = {"ckpt": str(ckpt), "dataset_path": str(data), "reward_fn_path": str(reward), "batch_size": 2,
           "n_samples": 2, "mini_bs": 2, "max_steps": 3, "max_new_tokens": 2, "dtype": "float32", "lr": 1e-3,
           "tensorboard": False}
    train(TrainConfig(**run, save_path=str(tmp_path / "often"), save_interval_minutes=1e-5))
    assert sorted(p.name for p in (tmp_path / "often").glob("step-*")) == ["step-1", "step-2", "step-3"]
    train(TrainConfig(**run, save_path=str(tmp_path / "hourly"), save_interval_minutes=60))
    assert sorted(p.name for p in (tmp_path / "hourly").glob("step-*")) == ["step-3"]  # only the end's
