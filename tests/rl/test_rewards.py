"""Reward scoring: a failing reward function (raising, hanging, returning NaN, a string or 10**400) costs one sample, is
counted and logged once; hung calls hold a bounded number of threads; records carry the row."""

import json
import logging
import math
import threading
import time

import pytest
import torch

from areno.rl.rewards import RewardRecord, record_from, score
from areno.training import plugins
from areno.training.plugins import stuck_calls


def _records(completions, answer="4"):
    row = {"prompt": "2+2?", "answer": answer, "_prompt_ids": [1, 2]}
    return [record_from(row, c, [7, 8], i) for i, c in enumerate(completions)]


def test_record_from_fills_fields_and_hides_internal_keys():
    r = record_from({"prompt": [{"role": "user", "content": "q"}], "answer": "4", "solution": "2+2=4", "id": 9,
                     "_prompt_ids": [1]}, "it is 4", (5, 6), 3)
    assert isinstance(r, RewardRecord)
    assert r.prompt == [{"role": "user", "content": "q"}] and r.completion == "it is 4" and r.tokens == [5, 6]
    assert r.answer == "4" and r.solutions == ["2+2=4"] and r.index == 3
    assert r.row == {"prompt": r.prompt, "answer": "4", "solution": "2+2=4", "id": 9}
    assert r["completion"] == "it is 4" and r["answer"] == "4" and r["id"] == 9 and "id" in r
    assert r.get("missing", 1) == 1
    with pytest.raises(KeyError):
        r["missing"]


@pytest.mark.parametrize("row,answer,solutions", [
    ({"prompt": "p", "answer": "4"}, "4", ["4"]),
    ({"prompt": "p", "solutions": ["4", "4.0"]}, "4", ["4", "4.0"]),
    ({"prompt": "p", "ground_truth": "x"}, "x", ["x"]),
    ({"prompt": "p", "answer": "4", "solutions": "four"}, "4", ["four"]),
    ({"prompt": "p"}, None, []),
])
def test_answer_and_solutions(row, answer, solutions):
    r = record_from(row, "c", [], 0)
    assert (r.answer, r.solutions) == (answer, solutions)


def test_scores_in_order_with_threads():
    fn = lambda rec: float(rec.completion == rec.answer)  # noqa: E731
    recs = _records(["4", "5", "4", "x"] * 5)
    assert score(fn, recs) == ([1.0, 0.0, 1.0, 0.0] * 5, 0)
    assert score(fn, recs, workers=4) == ([1.0, 0.0, 1.0, 0.0] * 5, 0)


def test_raising_reward_costs_one_sample_counted_and_logged_once(caplog):
    def fn(rec):
        if rec.completion == "bad":
            raise ZeroDivisionError("nope")
        return 1.0

    with caplog.at_level(logging.WARNING, logger="areno.rewards"):
        rewards, failures = score(fn, _records(["ok", "bad", "ok", "bad", "bad"]))
        assert (rewards, failures) == ([1.0, 0.0, 1.0, 0.0, 0.0], 3)
        rewards, failures = score(fn, _records(["bad", "ok"]), workers=2)  # a later step: counted, not logged again
        assert (rewards, failures) == ([0.0, 1.0], 1)
    logged = [r for r in caplog.records if r.name == "areno.rewards"]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert "ZeroDivisionError: nope" in logged[0].getMessage() and "Traceback" in logged[0].getMessage()


def test_distinct_failures_are_logged_separately(caplog):
    def fn(rec):
        if rec.completion == "a":
            raise KeyError("a")
        raise ValueError("b")

    with caplog.at_level(logging.WARNING, logger="areno.rewards"):
        assert score(fn, _records(["a", "b", "a", "b"])) == ([0.0] * 4, 4)
    msgs = [r.getMessage() for r in caplog.records if r.name == "areno.rewards"]
    assert len(msgs) == 2 and any("KeyError" in m for m in msgs) and any("ValueError" in m for m in msgs)


def test_bad_return_values_are_failures(caplog):
    values = {"nan": math.nan, "inf": -math.inf, "str": "1.0", "none": None, "list": [1.0], "big": torch.ones(2),
              "bool": True, "int": 2, "tensor": torch.tensor(0.5)}

    def fn(rec):
        return values[rec.completion]

    with caplog.at_level(logging.WARNING, logger="areno.rewards"):
        rewards, failures = score(fn, _records(list(values)))
    assert rewards == [0.0] * 6 + [1.0, 2.0, 0.5] and failures == 6
    assert all(isinstance(r, float) for r in rewards)
    assert len([r for r in caplog.records if r.name == "areno.rewards"]) == 2  # once per kind: non-number, non-finite


@pytest.mark.parametrize("exc", [SystemExit(0), SystemExit(3), KeyboardInterrupt()])
def test_sys_exit_or_keyboard_interrupt_from_user_code_costs_one_sample(exc):
    def fn(rec):
        if rec.completion == "bye":
            raise exc
        return 1.0

    assert score(fn, _records(["ok", "bye", "ok"])) == ([1.0, 0.0, 1.0], 1)


def test_a_hanging_reward_times_out_as_one_failed_sample_and_the_rest_are_scored(caplog):
    import threading
    import time

    release = threading.Event()

    def fn(rec):
        if rec.completion == "hang":
            release.wait(30)  # stands in for a call that never returns
            return 1.0
        return 1.0

    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="areno.rewards"):
        rewards, failures = score(fn, _records(["ok", "hang", "ok", "ok"]), timeout_s=0.3)
    took = time.monotonic() - t0
    release.set()
    assert (rewards, failures) == ([1.0, 0.0, 1.0, 1.0], 1)
    assert took < 3.0
    assert any("--reward-timeout-s" in r.getMessage() for r in caplog.records)


# ---- issue 37: a huge number kills no worker; hung calls hold a bounded number of threads ------------------------
def _score_within(seconds, *args, **kwargs):
    """score(...) on a thread: its result, or None if it has not returned after ``seconds`` (a hang)."""
    out = []
    worker = threading.Thread(target=lambda: out.append(score(*args, **kwargs)), daemon=True)
    worker.start()
    worker.join(seconds)
    return out[0] if out else None


@pytest.mark.parametrize("timeout_s", [None, 30.0])  # --reward-timeout-s 0 (none) and a long one
def test_nan_inf_string_and_huge_rewards_each_cost_their_sample_at_once(timeout_s):
    values = {"nan": math.nan, "inf": math.inf, "str": "abc", "huge": 10**400, "-huge": -(10**400), "ok": 0.25}
    t0 = time.monotonic()
    result = _score_within(10, lambda rec: values[rec.completion], _records(list(values) * 2), workers=2,
                           timeout_s=timeout_s)
    assert result is not None, "score() hung: 10**400 killed its worker thread"
    assert result == (([0.0] * 5 + [0.25]) * 2, 10)
    assert time.monotonic() - t0 < 5  # not a timeout's wait per sample


class Weird:
    def __float__(self):
        raise ArithmeticError("no float for you")

    def __repr__(self):
        raise RuntimeError("no repr either")


def test_a_value_whose_float_and_repr_raise_is_one_failure():
    assert _score_within(10, lambda rec: Weird(), _records(["a", "b"]), timeout_s=None) == ([0.0, 0.0], 2)


def test_hung_calls_hold_a_bounded_number_of_threads_over_many_steps(monkeypatch, caplog):
    monkeypatch.setattr(plugins, "STUCK_CALL_LIMIT", 4, raising=False)
    release = threading.Event()
    calls = []

    def fn(rec):
        calls.append(rec.index)
        if rec.index == 0:
            release.wait(60)  # every step one call never returns
        return 1.0

    base = threading.active_count()
    most = 0
    try:
        with caplog.at_level(logging.WARNING, logger="areno.rewards"):
            for _ in range(100):
                rewards, failures = score(fn, _records(["a"] * 4), workers=2, timeout_s=0.05)
                most = max(most, threading.active_count())
        assert most - base <= 4 + 2  # the stuck calls plus the workers, not one thread per step
        assert stuck_calls.count() == 4
        assert (rewards, failures) == ([0.0] * 4, 4)  # at the limit no call starts: every sample fails
        assert calls.count(0) == 4 and len(calls) < 4 * 4 + 4
        assert any("stuck" in r.getMessage() and "the run stops" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while stuck_calls.count() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stuck_calls.count() == 0  # released calls end and leave the count


def test_a_run_whose_reward_calls_keep_hanging_stops_with_a_line_and_a_checkpoint(tmp_path, monkeypatch, capsys):
    from areno.cli import main
    from areno.testing import make_tiny_checkpoint

    monkeypatch.setattr(plugins, "STUCK_CALL_LIMIT", 2, raising=False)
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", seed=0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)})
                            + "\n" for i in range(16)))
    flag = tmp_path / "release"
    reward = tmp_path / "reward.py"
    reward.write_text(f"import os, time\ncalls = [0]\n\ndef reward_fn(record):\n    calls[0] += 1\n"
                      f"    while record.index == 0 and not os.path.exists({str(flag)!r}):\n"
                      "        time.sleep(0.02)  # one call a step never returns\n"
                      "    return float(len(record.completion) % 2)\n")
    out = tmp_path / "out"
    try:
        try:
            code = main(["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward),
                         "--reward-timeout-s", "0.3", "--batch-size", "4", "--n-samples", "2", "--mini-bs", "8",
                         "--max-steps", "4", "--max-new-tokens", "4", "--save-path", str(out), "--lr", "1e-3",
                         "--no-tensorboard", "--dtype", "float32", "--eval-interval", "0"])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 1
        last = err.strip().splitlines()[-1]
        assert "2 calls of --reward-fn-path" in last and "stuck past their timeout" in last, last
        assert "stopping after step 2" in last and f"saved at {out / 'step-2'}" in last
        assert (out / "step-2" / "COMPLETE").is_file() and not (out / "step-3").exists()
    finally:
        flag.touch()
