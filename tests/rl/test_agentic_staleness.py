"""Agentic rollout with --max-staleness K > 0 in split mode (issue 42): the batches of agent episodes run ahead on a
background thread while the trainer steps, every sampled token stamped with the policy version of the engine that
sampled it (the token service answers with it); what trains stays within K versions; K = 0 stays on-policy. Split
runs on gloo (CPU), the tiny checkpoint and the three-turn agent of the split tests (tests/helpers/split_runs.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from areno.rl.agentic.session import token_versions
from tests.helpers.split_runs import AGENT, areno, ended, metrics, needs_gpus, started

SPLIT = ["--train-devices", "0", "--rollout-devices", "1", "--max-context-len", "400"]


def test_token_versions_fill_the_added_tokens_from_the_sampled_ones():
    assert token_versions([None, None]) is None  # colocated: nothing sampled carries a version
    assert token_versions([3, 3, None, None, 4, None]) == [3, 3, 3, 3, 4, 4]
    assert token_versions([None, 2, None]) == [2, 2, 2]  # before any sampled token: the first sampled one's


def check_ran_ahead(ms, dump, k: int, steps: int):
    """Step s trained a batch sent at step max(0, s - K): its tokens' versions, the lag and the staleness say so."""
    assert [m["step"] for m in ms] == list(range(1, steps + 1))
    lag = [min(s, k) for s in range(steps)]
    assert [m["staleness_max"] for m in ms] == [m["policy_version_lag_max"] for m in ms] == lag
    assert [m["policy_version"] for m in ms] == [s - min(s, k) for s in range(steps)]
    assert all(m["stale_dropped"] == 0 and m["agent_turns_mean"] == 3 and m["agent_forks"] == 0 for m in ms)
    for step in range(1, steps + 1):
        rows = [json.loads(x) for x in (dump / f"step-{step}.jsonl").read_text().splitlines()]
        assert rows
        for r in rows:  # one version per response token: the engine's at the step that sent the batch
            assert r["versions"] == [step - 1 - lag[step - 1]] * len(r["response_ids"])
            assert r["policy_version"] == step - 1 - lag[step - 1]


@pytest.mark.slow  # one split run (K = 1 runs in the resume test, as its uninterrupted run)
@needs_gpus(2)
def test_agent_batches_run_two_steps_ahead_and_tokens_carry_versions(files, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    out, dump = tmp_path / "k2", tmp_path / "dump"
    areno(files, out, "--agent-fn", str(agent), *SPLIT, "--max-staleness", "2", "--rollout-dump-dir", str(dump))
    check_ran_ahead(metrics(out), dump, 2, 3)


# the three-turn agent with its samples run one after another (a sample waits for the one before it to end): the
# engines draw each request's seed in arrival order, so this order makes a run reproducible to the bit
SERIAL = AGENT.replace("async def run_agent(", "async def episode(") + """
import asyncio, threading
done = [0]
lock = threading.Lock()

async def run_agent(ctx, batch):
    item = next(batch.iter_samples())
    while True:
        with lock:
            if done[0] % 8 == item.prompt_index * 2 + item.sample_index:
                break
        await asyncio.sleep(0.002)
    try:
        return await episode(ctx, batch)
    finally:
        with lock:
            done[0] += 1
"""


@needs_gpus(2)
def test_staleness_0_agent_run_equals_the_colocated_agent_run_bit_for_bit(files, tmp_path):
    agent = tmp_path / "serial.py"
    agent.write_text(SERIAL)
    common = ["--agent-fn", str(agent), "--max-context-len", "400"]
    colocated, split, dump = tmp_path / "colocated", tmp_path / "split", tmp_path / "dump"
    areno(files, colocated, *common, steps=2)
    areno(files, split, *common, *SPLIT[:4], "--max-staleness", "0", "--rollout-dump-dir", str(dump), steps=2)
    a, b = metrics(colocated), metrics(split)
    for key in ("loss", "reward_mean", "grad_norm", "logprob_diff", "agent_turns_mean"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert any(m["grad_norm"] > 0 for m in a)  # the runs learned something to compare
    assert [m["staleness_max"] for m in b] == [m["policy_version_lag_max"] for m in b] == [0, 0]
    assert all(m["stale_dropped"] == 0 for m in b)
    wa, wb = (load_file(str(d / "step-2" / "model.safetensors")) for d in (colocated, split))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for step in (1, 2):
        for r in map(json.loads, (dump / f"step-{step}.jsonl").read_text().splitlines()):
            assert r["versions"] == [step - 1] * len(r["response_ids"])


# the three-turn agent, killing the run on the third batch's first sample once the step-2 checkpoint is complete (that
# batch was sent ahead at step 2: its episodes are in flight while step 2 trains and saves)
KILLING = AGENT.replace("async def run_agent(ctx, batch):", """import os, signal, time
from pathlib import Path
from areno.training.checkpoint import is_complete
calls = [0]

async def run_agent(ctx, batch):
    calls[0] += 1
    if os.environ.get("KILL_AFTER") and calls[0] > 16:
        while not is_complete(Path(os.environ["KILL_AFTER"])):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)""")


@pytest.mark.slow  # three split runs
@needs_gpus(2)
def test_agent_batches_run_one_step_ahead_and_a_killed_run_resumes_at_the_batch_sent_ahead(files, tmp_path):
    """K = 1: each step trains the batch sent one step before (tokens of version step - 1). The checkpoint does not hold
    the episodes in flight: its data position is the batch sent ahead, which the
    resumed run samples again with the resumed policy (lag 0), so the run trains the same prompts at every step."""
    agent = tmp_path / "agent.py"
    agent.write_text(KILLING)
    args = ["--agent-fn", str(agent), *SPLIT, "--max-staleness", "1", "--save-interval", "1"]
    full, part = tmp_path / "full", tmp_path / "part"
    killed = started(files, part, *args, KILL_AFTER=str(part / "step-2"))  # overlaps the uninterrupted run
    areno(files, full, *args, "--rollout-dump-dir", str(tmp_path / "dump-full"))
    check_ran_ahead(metrics(full), tmp_path / "dump-full", 1, 3)  # K = 1: one batch ahead
    proc = ended(killed, ok=False)
    assert proc.returncode != 0 and (part / "step-2").is_dir() and not (part / "step-3").exists()
    areno(files, part, *args, "--resume", "--rollout-dump-dir", str(tmp_path / "dump-part"))
    a, b = metrics(full), metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3] and a[2]["staleness_max"] == 1 and b[2]["staleness_max"] == 0
    prompts = [sorted({tuple(json.loads(x)["prompt_ids"]) for x in (tmp_path / d / "step-3.jsonl").read_text()
                       .splitlines()}) for d in ("dump-full", "dump-part")]
    assert prompts[0] == prompts[1]
    for r in map(json.loads, (tmp_path / "dump-part" / "step-3.jsonl").read_text().splitlines()):
        assert r["versions"] == [2] * len(r["response_ids"])
