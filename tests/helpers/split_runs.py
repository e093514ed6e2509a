"""The split-mode tests' shared parts: the tiny checkpoint, sums dataset and reward (``make_files``), the ``areno
train`` subprocess they run (``areno``), its metrics, and the flag sets of the runs that several test files assert
different things on (tests/rl/conftest.py holds those runs once per session)."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areno.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]

KILLING_REWARD = """import os, signal
calls = [0]
def reward_fn(record):
    calls[0] += 1
    if os.environ.get("KILL_AT_CALL") and calls[0] == int(os.environ["KILL_AT_CALL"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return float(len(record.completion) % 3 == 0) + 0.1 * record.completion.count('1')
"""

AGENT = """
async def run_agent(ctx, batch):
    for item in batch.iter_samples():
        client = ctx.client(item)
        messages = list(item.messages)
        for turn in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": f"again {turn}"})
        return float(len(messages[-2].get("content") or "") % 2)
"""

# Runs that several tests assert different things on (each saves every step, so a resume test can use it as its
# uninterrupted run): on-policy split 1+1, async split (staleness 1, 4 steps) and on-policy LoRA split, each on 1+1
# slots; the policy-sync bucket size and ARENO_VERIFY_POLICY_SYNC change no number (the same run as plain
# `--max-staleness 0`).
ON_POLICY = ["--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "0", "--save-interval", "1",
             "--policy-sync-bucket-mb", "0.05"]
ASYNC = ["--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "1", "--save-interval", "1"]
LORA = ["--lora-rank", "4", "--lora-target-modules", "q_proj,v_proj,down_proj", "--lr", "5e-2"]
LORA_SPLIT = [*LORA, "--train-devices", "0", "--rollout-devices", "1", "--save-interval", "1"]


def make_files(root: Path):
    """(tiny qwen3 checkpoint, 32 one-digit sums as chat prompts, the reward file) under ``root``."""
    ckpt = make_tiny_checkpoint(root / "ckpt", family="qwen3", seed=0)
    rng = random.Random(0)
    rows = []
    for _ in range(32):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = root / "reward.py"
    reward.write_text(KILLING_REWARD)  # without KILL_AT_CALL: length % 3 == 0, plus 0.1 per "1"
    return ckpt, data, reward


def train_args(files, out, *extra, steps=3):
    ckpt, data, reward = files
    return ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward),
            "--batch-size", "4", "--n-samples", "2", "--mini-bs", "2", "--max-steps", str(steps),
            "--max-new-tokens", "6", "--save-path", str(out), "--lr", "1e-3", "--no-tensorboard", "--dtype",
            "float32", "--temperature", "1.0", *extra]


def env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


def areno(files, out, *extra, steps=3, **env_extra):
    proc = subprocess.run([sys.executable, "-m", "areno", *train_args(files, out, *extra, steps=steps)],
                          env=env(**env_extra), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def started(files, out, *extra, steps=3, **env_extra) -> subprocess.Popen:
    """``areno`` run in the background, for a test's runs that do not depend on each other: they overlap (each
    process of a run uses one thread, and a tiny run keeps less than a core busy); ``ended`` waits for it."""
    return subprocess.Popen([sys.executable, "-m", "areno", *train_args(files, out, *extra, steps=steps)],
                            env=env(**env_extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def ended(proc: subprocess.Popen, *, ok: bool = True) -> subprocess.CompletedProcess:
    """Wait for a ``started`` run (10 minutes at most); with ``ok``, assert it succeeded."""
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if ok:
        assert proc.returncode == 0, err[-4000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def metrics(out):
    return [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]


def same_run(a, b, *, steps):
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(1, steps + 1))
    for key in ("reward_mean", "reward_std", "loss", "grad_norm"):
        for x, y in zip(ma, mb):
            assert x[key] == pytest.approx(y[key], abs=1e-5, rel=1e-5), key
    wa = load_file(str(a / f"step-{steps}" / "model.safetensors"))
    wb = load_file(str(b / f"step-{steps}" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def needs_gpus(n: int):
    """On a CUDA host the indices are GPUs: skip where there are too few (the CPU runs every topology on gloo)."""
    return pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < n,
                              reason=f"needs {n} GPUs on a CUDA host")
