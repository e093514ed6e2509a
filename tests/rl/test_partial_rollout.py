"""Partial rollout and staleness K (issue 42). The rollout rank's driver on a real engine: new weights swapped in
mid-generation (recompute: the tokens after the swap are the new policy's; keep: the old K/V stay), every token's
version, a long tail cut into the next batch. Split runs on gloo (CPU): --max-staleness 3 --partial-rollout keeps the
trained samples within K and its tokens carry versions; K = 0 equals the colocated (synchronous) run bit for bit; a
killed async partial run resumes exactly, the rollouts in flight (and their tokens' versions) from its checkpoint."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model, load_tokenizer
from areno.rl.rollout.partial import PartialRollout
from areno.testing import make_tiny_checkpoint
from tests.helpers.split_runs import KILLING_REWARD, areno, ended, env, metrics, needs_gpus, started


@pytest.fixture(scope="module")
def two_policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    old, new = (load_model(make_tiny_checkpoint(root / n, family="qwen3", seed=s), dtype=torch.float32, device="cpu")
                for n, s in (("old", 2), ("new", 5)))
    return old, new, load_tokenizer(root / "old")


def _logprobs(model, prompt, tokens):
    """The full forward's log-probs of ``tokens`` after ``prompt`` at temperature 1 (float64 softmax)."""
    with torch.no_grad():
        logits = model.logits(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_weights_swapped_mid_generation(two_policies, kv):
    old, new, tok = two_policies
    model = copy.deepcopy(old)  # the swap copies ``new`` into it in place
    engine = Engine(model, tok, EngineConfig(block_size=4, max_running=8))
    driver = PartialRollout(engine, decode_steps=1, recompute=kv == "recompute", tail_steps=0)
    prompt = tok.encode("hello world, 12 + 3 =")
    opts = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=7)
    driver.add(0, [prompt], [opts], keys=["p"])
    for _ in range(4):  # the prompt's prefill (and its first token), then three decode steps
        engine.step()

    def load():
        with torch.no_grad():
            for p, q in zip(model.parameters(), new.parameters()):
                p.copy_(q)

    driver.swap(load, version=1)
    [(key, [c])] = driver.run(0)
    assert key == "p" and c.versions == [0] * 4 + [1] * 6 and len(c.token_ids) == 10
    lp = torch.tensor(c.logprobs, dtype=torch.float64)
    assert torch.allclose(lp[:4], _logprobs(old, prompt, c.token_ids)[:4], atol=1e-4)  # sampled by the old policy
    after = _logprobs(new, prompt, c.token_ids)[4:]
    if kv == "recompute":  # the new policy's own distribution over the whole context
        assert torch.allclose(lp[4:], after, atol=1e-4)
    else:  # the old policy's K/V of the context stay: not the new policy's full forward
        assert (lp[4:] - after).abs().max() > 1e-3
    assert driver.batches == {} and driver.versions == {}


def test_lookahead_reads_the_queued_group_before_a_swap(two_policies):
    """With the engine's lookahead (CUDA's default; forced here) a decode group is queued before the one in flight is
    read, so a command whose batch ends on a stop token mid-group ends with a group of the other batch's rows queued
    under the old weights: the swap reads it first and its tokens carry the old version (the old policy's
    log-probs). Every token before that is the run without lookahead's, and the versions change once, one group
    later than there."""
    old, new, tok = two_policies
    prompts = [tok.encode(t) for t in ("the cat", "1 + 1 =", "tool call")]
    opts = [SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=3 + i)
            for i, n in enumerate((30, 24, 21))]
    ref = Engine(copy.deepcopy(old), tok, EngineConfig(block_size=4, max_running=8)).generate(prompts[:1], opts[:1])
    stop = ref[0][0].token_ids[6]  # the first batch stops here: inside its second 3-step group
    opts[0] = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True, seed=3, stop_token_ids=[stop])
    out, queued = {}, {}
    for ahead in (False, True):
        model = copy.deepcopy(old)
        engine = Engine(model, tok, EngineConfig(block_size=4, max_running=8, lookahead=ahead))
        launch, queued[ahead] = engine.runner.launch_decode_steps, []
        engine.runner.launch_decode_steps = lambda *a, run=launch, q=queued[ahead], **kw: (
            q.append("ids_from" in kw) or run(*a, **kw))
        driver = PartialRollout(engine, decode_steps=3, recompute=False, tail_steps=0)
        driver.add(0, prompts[:1], opts[:1], keys=[0])
        driver.add(1, prompts[1:], opts[1:], keys=[1, 2])
        first = driver.run(0)  # batch 1 decodes alongside and is still running

        def load(model=model):
            with torch.no_grad():
                for p, q in zip(model.parameters(), new.parameters()):
                    p.copy_(q)

        driver.swap(load, version=1)
        out[ahead] = {k: c for k, [c] in first + driver.run(1)}
        assert not engine.has_work() and driver.versions == {}
    assert any(queued[True]) and not any(queued[False])
    assert out[True][0].token_ids == out[False][0].token_ids and out[True][0].finish_reason == "stop"
    for key in (1, 2):
        plain, looked = out[False][key], out[True][key]
        n = opts[key].max_new_tokens
        assert len(looked.token_ids) == n and len(looked.versions) == n
        before, kept = plain.versions.count(0), looked.versions.count(0)
        assert looked.versions == [0] * kept + [1] * (n - kept) and kept == before + 3  # the queued group's 3
        assert looked.token_ids[:before] == plain.token_ids[:before]
        lp = torch.tensor(looked.logprobs[:kept], dtype=torch.float64)
        assert torch.allclose(lp, _logprobs(old, prompts[key], looked.token_ids)[:kept], atol=1e-4)


def test_a_long_tail_is_cut_into_the_next_batch(two_policies):
    old, _, tok = two_policies
    prompts = [tok.encode(t) for t in ("a", "the cat", "1 + 1 =", "tool call")]
    short, long = (SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=1) for n in (2, 30))
    for tail, delivered in ((0, [[0, 1, 2, 3], [9]]), (2, [[0, 1, 2], [3, 9]])):
        driver = PartialRollout(Engine(old, tok, EngineConfig(block_size=4, max_running=8)), decode_steps=1,
                                recompute=False, tail_steps=tail)
        driver.add(0, prompts, [short, short, short, long], keys=[0, 1, 2, 3])
        driver.add(1, prompts[:1], [short], keys=[9])
        first = driver.run(0)
        cut = driver.cut
        second = driver.drain()[1]
        assert [[k for k, _ in first], [k for k, _ in second]] == delivered
        assert cut == (tail > 0)
        groups = dict(first + second)
        assert len(groups[3][0].token_ids) == 30 and groups[3][0].versions == [0] * 30
        assert all(len(groups[k][0].token_ids) == 2 for k in (0, 1, 2, 9))


pytestmark = needs_gpus(2)
SPLIT = ["--train-devices", "0", "--rollout-devices", "1"]
# a batch and a half (12 sequences; the engine holds --max-running-prompts sequences, forks included): the rollout
# rank starts the next batch while the last one's tail decodes, and cut tails continue under newer weights
PARTIAL = [*SPLIT, "--max-staleness", "3", "--partial-rollout", "--max-tail-steps", "1", "--max-running-prompts", "12",
           "--stop", "1", "--max-new-tokens", "12"]


def test_partial_rollout_with_staleness_3_keeps_samples_within_k(files, tmp_path):
    out, dump = tmp_path / "run", tmp_path / "dump"
    areno(files, out, *PARTIAL, "--rollout-dump-dir", str(dump), steps=6)
    ms = metrics(out)
    assert [m["step"] for m in ms] == list(range(1, 7))
    assert all(m["policy_version_lag_max"] <= 3 for m in ms)  # what trained is within K
    assert all(m["stale_dropped"] >= 0 and (m["staleness_max"] <= 3 or m["stale_dropped"] > 0) for m in ms)
    assert max(m["staleness_max"] for m in ms) >= 2  # the rollouts ran ahead
    mixed = 0
    for step in range(1, 7):
        for r in map(json.loads, (dump / f"step-{step}.jsonl").read_text().splitlines()):
            v = r["versions"]
            assert len(v) == len(r["response_ids"]) and v == sorted(v)  # one version per token, never going back
            assert 0 <= v[0] and v[-1] <= step - 1  # no token from a policy newer than the one trained
            mixed += len(set(v)) > 1
    assert mixed > 0  # some generations continued under a newer policy


def test_staleness_2_sends_two_rollouts_ahead(files, tmp_path):
    """Without partial rollout every sample of a rollout sent K steps ahead is K versions old (none dropped)."""
    out = tmp_path / "k2"
    areno(files, out, *SPLIT, "--max-staleness", "2", steps=5)
    ms = metrics(out)
    assert [m["staleness_max"] for m in ms] == [m["policy_version_lag_max"] for m in ms] == [0, 1, 2, 2, 2]
    assert [m["policy_version"] for m in ms] == [0, 0, 0, 1, 2] and all(m["stale_dropped"] == 0 for m in ms)


def test_staleness_0_equals_the_synchronous_run_bit_for_bit(colocated, on_policy_split):
    sync, split = colocated, on_policy_split  # the session's runs (tests/rl/conftest.py): --max-staleness 0
    a, b = metrics(sync), metrics(split)
    for key in ("loss", "reward_mean", "grad_norm", "logprob_diff"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert all(m["stale_dropped"] == 0 and m["policy_version_lag_max"] == 0 for m in b)
    wa, wb = (load_file(str(d / "step-3" / "model.safetensors")) for d in (sync, split))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # three split runs
def test_partial_rollout_resumes_exactly(files, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(KILLING_REWARD)
    files = (files[0], files[1], reward)
    args = [*PARTIAL[:-4], "--max-staleness", "2", "--max-new-tokens", "12", "--save-interval", "1"]
    full, part = tmp_path / "full", tmp_path / "part"
    killed = started(files, part, *args, steps=5, KILL_AT_CALL=str(2 * 8 + 1))  # overlaps the uninterrupted run
    areno(files, full, *args, "--rollout-dump-dir", str(tmp_path / "dump-full"), steps=5)
    proc = ended(killed, ok=False)
    assert proc.returncode != 0  # killed while scoring step 3 (or later), after step 2's save
    assert (part / "step-2").is_dir() and not (part / "step-5").exists()
    areno(files, part, *args, "--resume", "--rollout-dump-dir", str(tmp_path / "dump-part"), steps=5)
    a, b = metrics(full), metrics(part)
    assert [m["step"] for m in b] == [m["step"] for m in a] == [1, 2, 3, 4, 5]
    for key in ("loss", "reward_mean", "grad_norm", "staleness_max", "policy_version_lag_mean", "tail_cut"):
        assert [m.get(key) for m in b] == [m.get(key) for m in a], key
    for step in (4, 5):  # the tokens' versions too (step 3 may be the killed run's: its dump was written again)
        va, vb = ([json.loads(x)["versions"] for x in (tmp_path / d / f"step-{step}.jsonl").read_text().splitlines()]
                  for d in ("dump-full", "dump-part"))
        assert va == vb
    wa, wb = (load_file(str(d / "step-5" / "model.safetensors")) for d in (full, part))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _quickstart(tmp_path, name, *extra) -> dict:
    save = tmp_path / name
    cmd = [sys.executable, "-m", "areno", "train", "--preset", "quickstart", "--save-path", str(save), *SPLIT,
           "--max-steps", "12", *extra]
    proc = subprocess.run(cmd, env=env(ARENO_HOME=str(tmp_path / "home")), cwd=tmp_path, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(x) for x in (save / "metrics" / "metrics.jsonl").read_text().splitlines()][-1]


@pytest.mark.skipif(not os.environ.get("ARENO_FIGURES"), reason="the async learning figure (two quickstart runs, "
                    "about 4 min of CPU): ARENO_FIGURES=1 runs it")
def test_async_partial_quickstart_learns_like_the_synchronous_run(tmp_path):
    """The quickstart with --max-staleness 2 --partial-rollout reaches the synchronous split run's held-out accuracy
    within 2 points after the same 12 optimizer steps (issue 42's CPU learning figure)."""
    sync = _quickstart(tmp_path, "sync", "--max-staleness", "0")
    part = _quickstart(tmp_path, "partial", "--max-staleness", "2", "--partial-rollout")
    print(f"held-out accuracy after 12 steps: synchronous {sync['eval_accuracy_after']:.1%}, K=2 + partial rollout "
          f"{part['eval_accuracy_after']:.1%} (before: {sync['eval_accuracy_before']:.1%})")
    assert part["eval_accuracy_after"] >= sync["eval_accuracy_after"] - 0.02
