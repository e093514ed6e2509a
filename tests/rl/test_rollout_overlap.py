"""Scoring and tensorising prompt groups while the rest decode (areno.rl.rollout.finished_groups) changes nothing:
two GRPO steps on a tiny quickstart-style model (a short SFT warm-up so that samples stop at EOS at different steps)
give the same rollouts, rewards (failures included), advantages, metrics and updated weights, bit for bit, as the
previous sequential order (decode everything, then decode the texts, then score every record in one call). Also the
engine's ``on_finished`` callback, the batched text decode and the worker's error handling."""

import json
import random
import sys
import time
import types

import pytest
import torch

from areno.config import SamplingParams, TrainConfig
from areno.engine.engine import Completion, Engine, EngineConfig
from areno.models import load_model, load_tokenizer
from areno.rl.loop import TrainLoop
from areno.rl.rewards import completion_texts, record_from, score
from areno.rl.rollout.finished_groups import SWITCH_INTERVAL_S, FinishedGroups
from areno.testing import make_tiny_checkpoint
from areno.training.batch import Row
from areno.training.data import Prompt

REWARD = '''
def reward_fn(record):
    c = record.completion
    if len(c) % 5 == 1:
        raise ValueError("a reward function bug on this sample")
    if len(c) % 5 == 2:
        return None  # not a number: a failure too
    return float(c.strip() == record["answer"]) + 0.01 * len(c)
'''


@pytest.fixture(scope="module")
def setup_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    ckpt = make_tiny_checkpoint(root / "ckpt", family="qwen3", seed=0)
    rng = random.Random(0)
    rows = []
    for _ in range(32):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "response": str(a + b),
                     "answer": str(a + b)})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return ckpt, data, reward, root


def sequential_rollout(self, batch, upcoming=None):
    """StepRollout as it was before the overlap: the whole rollout, then every text, then one score call."""
    mine = self.rollout.share(batch)
    results, split_stats = self.rollout.rollout([self.engine_prompt(p) for p in mine],
                                                SamplingParams.from_train_config(self.cfg))
    records, flat = [], []
    for p, group in zip(mine, results):
        for c in group:
            text = c.text if c.text is not None else self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            records.append(record_from(p.row, text, c.token_ids, len(records)))
            flat.append((p, c))
    rewards, failures = score(self.reward_fn, records, timeout_s=self.cfg.reward_timeout_s or None)
    where = {id(p): i for i, p in enumerate(batch)}
    rows = [Row(p.ids, list(c.token_ids), list(c.logprobs), reward=float(rew),
                meta={"finish_reason": c.finish_reason}, media=self.media_of(batch[where[id(p)]]))
            for (p, c), rew in zip(flat, rewards)]
    n_tok = sum(len(r.response_ids) for r in rows)
    return rows, {"reward_failures": failures, "samples": len(rows), "response_len_mean": n_tok / len(rows),
                  "response_len_max": max(len(r.response_ids) for r in rows),
                  "truncated_frac": sum(r.meta["finish_reason"] == "length" for r in rows) / len(rows)}


def wait_until_scored(finished: FinishedGroups, i: int) -> None:
    """Hold the engine until the worker has scored group ``i``: the overlap then happens on any machine load."""
    deadline = time.monotonic() + 60
    while finished.rewards[i] is None and finished._error is None and time.monotonic() < deadline:
        time.sleep(0.001)


def two_steps(setup_files, sequential: bool, monkeypatch):
    ckpt, data, reward, root = setup_files
    cfg = TrainConfig(ckpt=str(ckpt), dataset_path=str(data), reward_fn_path=str(reward), algo="grpo", batch_size=8,
                      n_samples=4, mini_bs=8, gradient_accumulation_steps=4, max_new_tokens=10, decode_steps=2,
                      sft_warmup_steps=4, sft_warmup_lr=3e-3, dtype="float32", lr=1e-3, tensorboard=False,
                      metrics_dir=str(root / f"m-{sequential}"), seed=0, max_steps=2)
    loop = TrainLoop(cfg)
    loop.setup()
    loop.warmup()
    if sequential:
        loop.ctx.rollout = types.MethodType(sequential_rollout, loop.step_rollout)
    else:
        add = FinishedGroups.add
        monkeypatch.setattr(FinishedGroups, "add", lambda self, i, c: (add(self, i, c), wait_until_scored(self, i)))
    seen, train = [], loop.trainer.train

    def recording_train(rows, *a, **k):
        seen.append([(r.prompt_ids, r.response_ids, r.rollout_logprobs, r.reward, r.advantage, r.meta["sample"],
                      r.ids_tensor is not None) for r in rows])
        return train(rows, *a, **k)

    loop.trainer.train = recording_train
    metrics, batches = [], iter(loop.data)
    for _ in range(2):
        metrics.append(loop.step(next(batches)))
        loop.step_index += 1
    loop.close()
    return metrics, seen, [p.detach().clone() for p in loop.model.parameters()]


def test_overlapped_rollout_gives_the_sequential_steps_bit_for_bit(setup_files, monkeypatch):
    m_seq, rows_seq, w_seq = two_steps(setup_files, True, monkeypatch)
    m_ovl, rows_ovl, w_ovl = two_steps(setup_files, False, monkeypatch)
    for a, b in zip(m_seq, m_ovl):
        keys = {k for k in a if not k.endswith("_s")}
        assert keys <= b.keys()
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    strip = lambda steps: [[r[:-1] for r in rows] for rows in steps]  # noqa: E731 - all but "had tensors"
    assert strip(rows_seq) == strip(rows_ovl)
    assert all(torch.equal(a, b) for a, b in zip(w_seq, w_ovl))
    # the overlap happened: groups scored and tensorised while others decoded, failing rewards among them
    assert all(m["overlap_groups"] > 0 for m in m_ovl) and any(r[-1] for rows in rows_ovl for r in rows)
    assert all(m["reward_failures"] > 0 for m in m_ovl)
    assert len({len(r[1]) for rows in rows_ovl for r in rows}) > 2  # samples stopped at different lengths
    assert all(m["reward_work_s"] >= m["overlap_saved_s"] >= 0 and m["pack_s"] >= 0 for m in m_ovl)
    assert sys.getswitchinterval() > SWITCH_INTERVAL_S  # restored after each rollout


@pytest.fixture(scope="module")
def engine(setup_files):
    ckpt = setup_files[0]
    model = load_model(ckpt, dtype=torch.float32, device="cpu")
    model.eval()
    return Engine(model, load_tokenizer(ckpt), EngineConfig(max_running=32, max_model_len=64, decode_steps=2, seed=0))


def test_engine_reports_each_group_once_as_soon_as_it_finishes(engine):
    lengths = [7, 2, 5, 3]  # per prompt: every sample runs to its max_new_tokens, so prompt 1 finishes first
    options = [SamplingParams(temperature=1.0, max_new_tokens=m, n=3, ignore_eos=True) for m in lengths]
    reported = []
    out = engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], options,
                          on_finished=lambda i, comps: reported.append((i, comps, engine.has_work())))
    assert [i for i, _, _ in reported] == [1, 3, 2, 0]
    assert [busy for _, _, busy in reported] == [True, True, True, False]  # the others were still decoding
    for i, comps, _ in reported:
        assert comps is out[i] and [len(c.token_ids) for c in comps] == [lengths[i]] * 3


def test_completion_texts_match_the_tokenizer_one_by_one(engine):
    tok = engine.tokenizer
    rng = random.Random(1)
    ids = [[rng.randrange(len(tok)) for _ in range(rng.randint(0, 30))] for _ in range(40)]
    comps = [Completion(0, 0, [1], x, [0.0] * len(x), "length") for x in ids]
    comps[3].text = "cut at a stop string"
    want = [tok.decode(x, skip_special_tokens=True) for x in ids]
    want[3] = "cut at a stop string"
    assert completion_texts(tok, comps) == want

    class OwnDecode:  # not a plain tokenizers backend: decoded one by one with its own decode
        def decode(self, ids, skip_special_tokens=False):
            return "|".join(map(str, ids))

    assert completion_texts(OwnDecode(), comps[:2]) == ["|".join(map(str, x)) for x in ids[:2]]


def test_finished_groups_overlap_slow_rewards_with_the_decode(engine, monkeypatch):
    def slow_reward(record):
        time.sleep(0.03)
        return float(len(record.tokens))

    rows = [Prompt({"answer": str(i)}, i, [5 + i, 6]) for i in range(4)]
    lengths = [12, 2, 3, 4]
    options = [SamplingParams(temperature=1.0, max_new_tokens=m, n=2, ignore_eos=True) for m in lengths]
    finished = FinishedGroups(rows, 2, engine.tokenizer, slow_reward)
    try:
        out = engine.generate([p.ids for p in rows], options,
                              on_finished=lambda i, c: (finished.add(i, c), i and wait_until_scored(finished, i)))
        rewards, failures, tensors = finished.finish(out)
    finally:
        finished.close()
    assert rewards == [[float(m)] * 2 for m in lengths] and failures == 0
    # groups 1-3 (2 samples x 30 ms each) were scored while group 0 still decoded, group 0 (the last) around its end
    assert finished.early_groups >= 3 and finished.overlap_s >= 0.17 and finished.busy_s >= 0.23
    for group, made in zip(out, tensors):
        for c, (ids, lps) in zip(group, made or []):
            assert ids.tolist() == c.prompt_ids + c.token_ids and lps.tolist() == pytest.approx(c.logprobs)


def test_a_failing_worker_raises_on_the_loop_thread_and_the_switch_interval_comes_back(engine):
    class Broken:
        def decode(self, ids, skip_special_tokens=False):
            raise RuntimeError("tokenizer broke")

    before = sys.getswitchinterval()
    finished = FinishedGroups([Prompt({}, 0, [5])], 1, Broken(), lambda r: 1.0)
    assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))
    comps = [[Completion(0, 0, [5], [6, 7], [0.0, 0.0], "length")]]
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        finished.finish(comps)
    finished.close()
    assert sys.getswitchinterval() == before
    idle = FinishedGroups([Prompt({}, 0, [5])], 1, Broken(), lambda r: 1.0)
    idle.close()  # the rollout failed before finish(): the worker stops all the same
    assert not idle._thread.is_alive() and sys.getswitchinterval() == before
