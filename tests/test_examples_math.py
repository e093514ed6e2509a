"""examples/math: the GSM8K loader and the math-verify reward.

Every test runs on the few rows shipped in ``tests/data/gsm8k`` (so a fresh clone passes), and again on the full copy
in ``../shared/data/gsm8k`` beside the checkout where it exists; without it the full-data runs skip, saying where to
get the files and where to put them.
"""

import random
from pathlib import Path

import pytest

from areno.rl.rewards import record_from, score
from areno.training import data
from areno.training.data import DatasetError, check_rows, load_rows
from areno.training.plugins import load_dataset_loader, load_reward_fn

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "gsm8k"  # 15 train + 20 test rows, see its README.md
SHARED = ROOT.parent / "shared" / "data" / "gsm8k"  # the full data set, beside the checkout (not in a fresh clone)
EXAMPLES = ROOT / "examples" / "math"


@pytest.fixture(scope="module")
def reward_fn():
    return load_reward_fn(str(EXAMPLES / "math_verify_reward.py"))


@pytest.fixture(scope="module")
def loader():
    return load_dataset_loader(str(EXAMPLES / "dataset_loader.py"))


@pytest.fixture(scope="module", params=[
    pytest.param((FIXTURE, 15, 20), id="fixture"),
    pytest.param((SHARED, 7473, 1319), id="full", marks=pytest.mark.skipif(
        not (SHARED / "train.jsonl").exists() or not (SHARED / "test.jsonl").exists(),
        reason=f"needs the full GSM8K set (7473 + 1319 rows; the 35 rows of tests/data/gsm8k ran): put train.jsonl "
               f"and test.jsonl of github.com/openai/grade-school-math (grade_school_math/data/) in {SHARED}")),
])
def gsm8k(request):
    """(folder, train rows, test rows) of one GSM8K copy."""
    return request.param


@pytest.fixture(scope="module")
def test_rows(loader, gsm8k):
    folder, _, n_test = gsm8k
    rows = load_rows(str(folder / "test.jsonl"), loader_fn=loader)
    assert len(rows) == n_test
    return rows


def _score(reward_fn, pairs):
    records = [record_from(row, completion, [], i) for i, (row, completion) in enumerate(pairs)]
    return score(reward_fn, records)


def test_loader_builds_valid_rows_from_the_local_train_file(loader, gsm8k):
    folder, n_train, _ = gsm8k
    rows = load_rows(str(folder / "train.jsonl"), loader_fn=loader)
    assert len(rows) == n_train
    check_rows(rows, "gspo")
    first = rows[0]
    assert set(first) == {"prompt", "answer", "solution"}
    (msg,) = first["prompt"]
    assert msg["role"] == "user" and msg["content"].startswith("Natalia sold clips")
    assert "step by step" in msg["content"] and "\\boxed{}" in msg["content"]
    assert first["answer"] == "72" and first["solution"].endswith("#### 72")
    assert all("," not in r["answer"] and r["answer"] for r in rows)  # "1,000" -> "1000"
    assert any(r["solution"].rsplit("####", 1)[1].strip() != r["answer"] for r in rows)
    assert any(r["answer"].startswith("-") for r in rows)


def test_reference_solutions_score_100_percent(reward_fn, test_rows):
    rewards, failures = _score(reward_fn, [(r, r["solution"]) for r in test_rows])
    assert failures == 0 and sum(rewards) == len(test_rows)


def test_boxed_answers_score_100_percent(reward_fn, test_rows):
    pairs = [(r, f"Let me think. The total is {r['answer']}.\nSo the answer is \\boxed{{{r['answer']}}}")
             for r in test_rows]
    rewards, failures = _score(reward_fn, pairs)
    assert failures == 0 and sum(rewards) == len(test_rows)


def test_wrong_answers_score_zero(reward_fn, test_rows):
    sample = random.Random(0).sample(test_rows, min(150, len(test_rows)))
    wrong = []
    for r in sample:
        n = int(r["answer"])
        wrong += [(r, f"\\boxed{{{n + 1}}}"), (r, f"The answer is {n - 7}."), (r, f"#### {n * 10 + 3}"),
                  (r, f"First {n} then \\boxed{{{n + 2}}}")]  # the last boxed answer counts, not an earlier number
    rewards, failures = _score(reward_fn, wrong)
    assert failures == 0 and sum(rewards) == 0


@pytest.mark.parametrize("completion,answer,expected", [
    ("#### 1,234", "1234", 1.0),
    ("so \\boxed{1,234}", "1234", 1.0),
    ("x \\boxed{-3}", "-3", 1.0),
    ("x \\boxed{3}", "-3", 0.0),
    ("\\boxed{5.00}", "5", 1.0),
    ("\\boxed{\\$18.00}", "18", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("\\boxed{\\frac{36}{2}}", "18", 1.0),  # math_verify: not a plain number
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{1} first, then \\boxed{2}", "2", 1.0),
    ("\\boxed{\\boxed{7}}", "7", 1.0),
    ("no marker: she pays 12 and keeps 30", "30", 1.0),  # last-number fallback
    ("no marker: she pays 12 and keeps 30", "12", 0.0),
    ("The reference says\n#### 1,000", "Answer: ... #### 1,000", 1.0),  # a raw GSM8K reference as the answer
    ("", "4", 0.0),
])
def test_answer_forms(reward_fn, completion, answer, expected):
    assert reward_fn(record_from({"prompt": "q", "answer": answer}, completion, [], 0)) == expected


def test_never_raises_on_ordinary_strings(reward_fn):
    rng = random.Random(1)
    alphabet = "0123456789-+.,/{}\\$#boxed frac^_()[]=*xyz \n\u00e9\u221a"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert reward_fn({"completion": text, "answer": "42", "solutions": ["42"]}) in (0.0, 1.0)
    assert reward_fn({"completion": "\\boxed{" * 50, "answer": "1", "solutions": []}) == 0.0
    assert reward_fn({"completion": "9" * 400, "answer": "9", "solutions": []}) == 0.0


def test_hub_default_fails_fast_offline(loader, monkeypatch, tmp_path):
    monkeypatch.setattr(data, "_hub_reachable", lambda timeout=0: False)
    with pytest.raises(DatasetError, match="could not fetch the hub dataset 'gsm8k' \\(config main"):
        # no --dataset-path: the example asks for gsm8k:main; kwargs reach datasets.load_dataset (an empty cache)
        load_rows(None, loader_fn=loader, cache_dir=str(tmp_path))


def test_extract_answer_votes_equal_values_together():
    """maj@K's votes (`areno eval`): the final answer, plain numbers written one way, None when there is none."""
    from areno.training.plugins import load_answer_extractor

    extract = load_answer_extractor(str(EXAMPLES / "math_verify_reward.py"))
    assert extract("so \\boxed{1,234.0}") == extract("#### 1234") == extract("it is 1234") == "1234"
    assert extract("5 then 7.5") == "7.5" and extract("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract("no answer here") is None
