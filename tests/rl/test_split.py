"""Split mode on CPU (gloo: device indices name process slots): training and rollout on separate ranks, the policy
streamed after each optimizer step. On-policy split runs equal the colocated run; the engines' weights equal the
trainer's after every sync; async keeps staleness at 1; a dead rollout rank ends the run naming it; two "nodes" under
torchrun on loopback equal one."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areno.distributed.launch import free_port
from tests.helpers.split_runs import (
    AGENT,
    ASYNC,
    LORA,
    LORA_SPLIT,
    ON_POLICY,
    ROOT,
    areno,
    env,
    metrics,
    needs_gpus,
    same_run,
    train_args,
)

pytestmark = needs_gpus(2)


@pytest.mark.parametrize("topology", [
    None,  # 1+1: the module's on-policy split run
    pytest.param(["--train-devices", "0,1", "--tp-size", "2", "--rollout-devices", "2,3", "--rollout-tp-size", "1"],
                 marks=needs_gpus(4)),
    pytest.param(["--train-devices", "0", "--rollout-devices", "1..2", "--rollout-tp-size", "2"], marks=needs_gpus(3)),
], ids=["1+1", "tp2+2x1", "1+tp2"])
def test_on_policy_split_equals_colocated_and_engines_hold_the_trainers_weights(files, colocated, tmp_path,
                                                                                 topology, request):
    if topology is None:
        out = request.getfixturevalue("on_policy_split")
    else:
        out = tmp_path / "split"
        areno(files, out, *topology, "--policy-sync-bucket-mb", "0.05", ARENO_VERIFY_POLICY_SYNC="1")
    same_run(colocated, out, steps=3)
    ms = metrics(out)
    assert all(m["staleness_max"] == 0 for m in ms)
    synced = [m for m in ms if "policy_sync_bytes" in m]
    assert [m["step"] for m in synced] == [2, 3]  # the engines start from --ckpt; every update is streamed
    assert all(m["policy_sync_verified"] == 1 and m["policy_sync_bytes"] > 0 for m in synced)
    assert [m["policy_version"] for m in ms] == [0, 1, 2]


def test_async_split_keeps_staleness_at_one(async_split):
    ms = metrics(async_split)
    assert [m["staleness_max"] for m in ms] == [0, 1, 1, 1]
    assert [m["policy_version"] for m in ms] == [0, 0, 1, 2]
    assert all(m["loss"] is not None for m in ms)


def test_two_nodes_on_loopback_equal_one(files, colocated, tmp_path):
    out = tmp_path / "nodes"
    port = free_port()
    argv = train_args(files, out, "--train-devices", "0", "--rollout-devices", "1")[1:]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "1", "--node-rank", str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "-m", "areno.train", *argv], env=env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    same_run(colocated, out, steps=3)


def _rollout_worker_pid(parent: int) -> int | None:
    """The launched process whose RANK is 1 (the rollout rank), among ``parent``'s descendants."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if b"RANK=1" in environ and b"ARENO_TRAIN_CONFIG" in b"".join(environ):
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent or int(Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                return int(pid)
    return None


def signal_the_rollout_rank(files, out, sig, *, within: float, **env_extra) -> tuple[int, str]:
    """A long split run; after its first step, ``sig`` to the rollout rank; the run must end ``within`` seconds,
    leaving no process behind. Returns (exit code, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "areno", *train_args(
        files, out, "--train-devices", "0", "--rollout-devices", "1", steps=500)],
        env=env(**env_extra), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics" / "metrics.jsonl").is_file() or not metrics(out):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.5)
        victim = _rollout_worker_pid(proc.pid)
        assert victim is not None
        os.kill(victim, sig)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=within + 60)
        assert time.monotonic() - t0 < within
    finally:
        proc.kill()
        if victim is not None:
            with contextlib.suppress(OSError):
                os.kill(victim, signal.SIGKILL)
    children = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not children, "orphan processes"
    return proc.returncode, err


def test_a_killed_rollout_rank_ends_the_run_naming_it(files, tmp_path):
    code, err = signal_the_rollout_rank(files, tmp_path / "killed", signal.SIGKILL, within=60)
    assert code == 1
    assert "rank 1 (rollout engine 0 rank 0 on CPU slot 1) was killed by SIGKILL" in err


def test_a_stopped_rollout_rank_ends_the_run_naming_it_after_the_rank_timeout(files, tmp_path):
    """SIGSTOP leaves the process alive but silent: the run's own timeout (not torch's 30 minutes) names it."""
    code, err = signal_the_rollout_rank(files, tmp_path / "stopped", signal.SIGSTOP, within=40,
                                        ARENO_RANK_TIMEOUT_S="4")
    assert code == 1
    assert "rank 1 (rollout engine 0 rank 0 on CPU slot 1) has not answered for" in err, err[-3000:]
    assert "ARENO_RANK_TIMEOUT_S=4" in err


SDK_SCRIPT = """
import json, sys
from areno import Trainer
from areno.api import CudaConfig, SamplingParams

ckpt, out, split = sys.argv[1], sys.argv[2], sys.argv[3] == "split"
cuda = CudaConfig(devices=[0], rollout_devices=[1]) if split else CudaConfig()
trainer = Trainer(world_size=1, model_path=ckpt, custom_config=cuda, dtype="float32", lr=1e-2, seed=3)
trainer.init()  # a rollout rank serves here until the trainer closes, then exits
params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0)
first = trainer.generate(["1+2=", "3+4="], params)
rows = [{"prompt_ids": c.prompt_ids, "response_ids": c.token_ids} for g in first for c in g]
trainer.train(rows, loss_fn="sft", mini_bs=4)
second = trainer.generate(["1+2=", "3+4="], params)
trainer.close()
json.dump([[c.token_ids for c in g] for g in first + second], open(out, "w"))
"""


def test_sdk_split_mode_under_torchrun_matches_the_colocated_sdk(files, tmp_path):
    ckpt = files[0]
    script = tmp_path / "sdk.py"
    script.write_text(SDK_SCRIPT)
    colo, split = tmp_path / "colo.json", tmp_path / "split.json"
    proc = subprocess.run([sys.executable, str(script), str(ckpt), str(colo), "colo"], env=env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
                           "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script), str(ckpt), str(split),
                           "split"], env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = json.loads(colo.read_text()), json.loads(split.read_text())
    assert a == b and a[:2] != a[2:]  # same samples before and after the update, and the update changed them


def test_async_split_quickstart_still_learns(tmp_path, quickstart_home):
    """--max-staleness 1 on the quickstart task: one step of policy lag, corrected by truncated importance sampling,
    still gains at least 10 points of held-out accuracy in 12 of the preset's 40 steps (measured on two cores: 68.5%
    -> 95.5%, +27 points, 115 s, most of it the preset's 500-step SFT warm-up; before the CPU attention path batched
    its sequences: 66.5% -> 90.5%, and --seed 1..4 +14.5 to +26 after 12 steps). The sync quickstart test proves the
    full preset learns. With the session's shared $ARENO_HOME the warm-up is that test's, loaded from the cache (the
    split trainer's warm-up is the colocated one's, bit for bit: areno/rl/warmup_cache.py)."""
    save = tmp_path / "run"
    cmd = [sys.executable, "-m", "areno", "train", "--preset", "quickstart", "--save-path", str(save),
           "--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "1", "--max-steps", "12"]
    proc = subprocess.run(cmd, env=env(ARENO_HOME=str(quickstart_home)), cwd=tmp_path, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(x) for x in (save / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "staleness_max" in r]
    assert len(steps) == 12 and max(r["staleness_max"] for r in steps) == 1
    final = records[-1]
    assert final["eval_accuracy_after"] - final["eval_accuracy_before"] >= 0.10, final


@pytest.mark.parametrize("topology", [["--rollout-devices", "1"],
                                      pytest.param(["--rollout-devices", "1,2", "--rollout-tp-size", "2"],
                                                   marks=needs_gpus(3))], ids=["1+1", "1+tp2"])
def test_agentic_rollout_in_split_mode(files, tmp_path, topology):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    out = tmp_path / "agentic"
    areno(files, out, "--agent-fn", str(agent), "--train-devices", "0", *topology, "--max-context-len", "400",
          ARENO_VERIFY_POLICY_SYNC="1")
    ms = metrics(out)
    assert [m["step"] for m in ms] == [1, 2, 3]
    assert all(m["agent_turns_mean"] == 3 and m["agent_forks"] == 0 for m in ms)
    assert all(m["logprob_diff_max"] < 1e-4 for m in ms)  # the engines sampled with the trainer's policy
    assert [m.get("policy_sync_verified") for m in ms] == [None, 1.0, 1.0]


def test_resume_in_split_mode_continues_exactly(files, on_policy_split, tmp_path):
    full, part = on_policy_split, tmp_path / "part"
    areno(files, part, *ON_POLICY, steps=2)
    areno(files, part, *ON_POLICY, "--resume", steps=3)  # the engines start from --ckpt: the resumed policy is synced
    a, b = metrics(full), metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3]
    assert b[2]["loss"] == pytest.approx(a[2]["loss"], abs=1e-6) and b[2]["reward_mean"] == a[2]["reward_mean"]
    assert b[2]["policy_sync_bytes"] > 0
    wa = load_file(str(full / "step-3" / "model.safetensors"))
    wb = load_file(str(part / "step-3" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # three split runs
def test_async_split_resume_repeats_the_uninterrupted_run(files, async_split, tmp_path):
    """--max-staleness 1: the checkpoint holds the rollout in flight (sampled with the previous policy), so the step
    after a resume trains on the very samples the uninterrupted run did, not on new ones from the newer policy."""
    full, part = async_split, tmp_path / "part"
    proc = subprocess.run([sys.executable, "-m", "areno", *train_args(files, part, *ASYNC, steps=4)],
                          env=env(KILL_AT_CALL=str(2 * 8 + 1)), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode != 0  # killed while scoring step 3, after step-2's save
    assert sorted(p.name for p in part.glob("step-*")) == ["step-1", "step-2"]
    areno(files, part, *ASYNC, "--resume", steps=4)
    a, b = metrics(full), metrics(part)
    assert [m["step"] for m in b] == [m["step"] for m in a] == [1, 2, 3, 4]
    for key in ("loss", "reward_mean", "reward_std", "grad_norm", "policy_version", "staleness_max"):
        assert [m.get(key) for m in b] == [m.get(key) for m in a], key
    wa = load_file(str(full / "step-4" / "model.safetensors"))
    wb = load_file(str(part / "step-4" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _ranks_of(out) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and str(out).encode() in Path(f"/proc/{pid}/environ").read_bytes():
                pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_no_rank_outlives_a_killed_launcher(files, tmp_path):
    out = tmp_path / "orphans"
    proc = subprocess.Popen([sys.executable, "-m", "areno",
                             *train_args(files, out, "--train-devices", "0", "--rollout-devices", "1", steps=500)],
                            env=env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics" / "metrics.jsonl").is_file() or not metrics(out):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        assert len(_ranks_of(out)) >= 2
        os.kill(proc.pid, signal.SIGKILL)  # no chance to stop its workers itself
        proc.wait()
        deadline = time.monotonic() + 30
        while _ranks_of(out) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _ranks_of(out), "a rank outlived the launcher"
    finally:
        proc.kill()
        for pid in _ranks_of(out):
            os.kill(pid, signal.SIGKILL)


def _adapter_bytes(folder) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(str(folder / "adapter_model.safetensors")).values())


def test_lora_split_streams_only_the_adapter_and_equals_the_colocated_lora_run(files, lora_split, tmp_path):
    """A LoRA run in split mode: the rollout rank holds the same base with the same adapter structure, each sync
    streams the adapter's tensors alone (its bytes exactly), the engine's copy equals the trainer's after every sync
    (verified), the rollout log-probs equal the trainer's adapted model's, and the whole run (sampled tokens through
    rewards, losses, the saved adapter) equals the colocated LoRA run's."""
    colo, split = tmp_path / "colo", lora_split
    areno(files, colo, *LORA)
    ms = metrics(split)
    adapter = _adapter_bytes(split / "step-3")
    assert not (split / "step-3" / "model.safetensors").exists()
    synced = [m for m in ms if "policy_sync_bytes" in m]
    assert [m["step"] for m in synced] == [2, 3]
    assert all(m["policy_sync_bytes"] == adapter and m["policy_sync_verified"] == 1 for m in synced)
    assert all(m["logprob_diff_max"] < 1e-4 for m in ms)  # the engine sampled with the trainer's adapted policy
    mc = metrics(colo)
    for key in ("reward_mean", "reward_std", "loss", "grad_norm"):
        assert [m[key] for m in ms] == pytest.approx([m[key] for m in mc], abs=1e-5, rel=1e-5), key
    a = load_file(str(colo / "step-3" / "adapter_model.safetensors"))
    b = load_file(str(split / "step-3" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_async_lora_split_streams_the_adapter_one_step_behind(files, tmp_path):
    out = tmp_path / "async"
    areno(files, out, "--lora-rank", "4", "--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "1",
          ARENO_VERIFY_POLICY_SYNC="1", steps=4)
    ms = metrics(out)
    assert [m["staleness_max"] for m in ms] == [0, 1, 1, 1]
    synced = [m for m in ms if "policy_sync_bytes" in m]
    assert synced and all(m["policy_sync_bytes"] == _adapter_bytes(out / "step-4") for m in synced)


@pytest.mark.slow  # three ranks each
@pytest.mark.parametrize("topology", [
    pytest.param(["--train-devices", "0,1", "--tp-size", "2", "--rollout-devices", "2", "--rollout-tp-size", "1"],
                 marks=needs_gpus(3)),
    pytest.param(["--train-devices", "0", "--rollout-devices", "1..2", "--rollout-tp-size", "2"], marks=needs_gpus(3)),
], ids=["tp2+1", "1+tp2"])
def test_lora_split_with_tensor_parallel_sides(files, tmp_path, topology):
    """The adapter gathered from the train-TP shards, sliced into the rollout-TP shards: the engines' copy equals the
    trainer's after every sync, only its bytes are streamed, and the rollout log-probs equal the trainer's."""
    out = tmp_path / "lora-tp"
    areno(files, out, "--lora-rank", "4", "--lr", "5e-2", *topology, ARENO_VERIFY_POLICY_SYNC="1")
    ms = metrics(out)
    synced = [m for m in ms if "policy_sync_bytes" in m]
    assert [m["step"] for m in synced] == [2, 3]
    assert all(m["policy_sync_bytes"] == _adapter_bytes(out / "step-3") and m["policy_sync_verified"] == 1
               for m in synced)
    assert all(m["logprob_diff_max"] < 1e-4 for m in ms)


def test_lora_split_streams_the_warm_up_s_base_once(files, tmp_path):
    """An --sft-warmup-steps warm-up trains the base itself: the first sync after it streams base and adapter, the
    later ones the adapter alone; the engine samples with the trained base throughout."""
    rows = [json.loads(x) for x in files[1].read_text().splitlines()]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({**r, "response": r["answer"]}) + "\n" for r in rows))
    out = tmp_path / "warm"
    areno((files[0], data, files[2]), out, "--lora-rank", "4", "--sft-warmup-steps", "2", "--train-devices", "0",
          "--rollout-devices", "1", ARENO_VERIFY_POLICY_SYNC="1")
    ms = [m for m in metrics(out) if m["step"] > 0]
    adapter = _adapter_bytes(out / "step-3")
    base = sum(t.numel() * t.element_size() for t in load_file(str(out / "step-3" / "base" / "model.safetensors")
                                                                ).values())
    assert [m["policy_sync_bytes"] for m in ms] == [base + adapter, adapter, adapter]
    assert all(m["policy_sync_verified"] == 1 and m["logprob_diff_max"] < 1e-4 for m in ms)


@pytest.mark.slow  # three split runs
def test_lora_split_resume_continues_exactly(files, lora_split, tmp_path):
    """After a resume the engines hold --ckpt's base and a zero adapter: the first sync streams base and adapter (the
    resumed one), and step 3 repeats the uninterrupted run's."""
    full, part = lora_split, tmp_path / "part"
    areno(files, part, *LORA_SPLIT, steps=2)
    areno(files, part, *LORA_SPLIT, "--resume", steps=3)
    a, b = metrics(full), metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3]
    assert b[2]["loss"] == pytest.approx(a[2]["loss"], abs=1e-6) and b[2]["reward_mean"] == a[2]["reward_mean"]
    assert b[2]["policy_sync_bytes"] > a[2]["policy_sync_bytes"] == _adapter_bytes(full / "step-3")  # base too
    wa = load_file(str(full / "step-3" / "adapter_model.safetensors"))
    wb = load_file(str(part / "step-3" / "adapter_model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
