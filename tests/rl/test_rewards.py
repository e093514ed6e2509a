"""Reward scoring: a failing reward function costs one sample, is counted and logged once; records carry the row."""

import logging
import math

import pytest
import torch

from areno.rl.rewards import RewardRecord, record_from, score


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
