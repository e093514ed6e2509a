"""The evaluation metrics against exact references: pass@k against C(n-c,k)/C(n,k) in exact rationals, the majority
vote against a by-hand count, the bootstrap interval's coverage and seeding."""

import math
import random
from fractions import Fraction

import numpy as np
import pytest

from areno.rl.eval_metrics import bootstrap_interval, ks_for, majority, pass_at_k, per_prompt, summarize


def exact_pass_at_k(n, c, k) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize("n", [1, 2, 5, 16, 64, 1024])
def test_pass_at_k_matches_the_exact_binomial_form(n):
    rng = random.Random(n)
    for c in sorted({0, 1, n // 2, n - 1, n, rng.randrange(n + 1)}):
        if c < 0:
            continue
        for k in ks_for(n):
            assert pass_at_k(n, c, k) == pytest.approx(exact_pass_at_k(n, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_edges_and_errors():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8, rel=1e-15)  # pass@1 is the fraction correct
    assert pass_at_k(10, 5, 6) == 1.0  # n - c < k
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_ks_are_powers_of_two_and_k():
    assert ks_for(1) == [1] and ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6]


def test_majority_vote_and_its_tie_rule():
    assert majority(["3", "4", "4", None, "3", "4"]) == 1  # "4" has three votes; its first holder is sample 1
    assert majority([None, "7", "5", "5", "7"]) == 1  # tie 2-2: "7" appeared first
    assert majority([None, None]) is None
    assert majority(["a", "b", "c"]) == 0


def test_per_prompt_values():
    scores = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    answers = ["5", "6", "6", "5", "6", None, "7", "6"]
    p = per_prompt(scores, answers)
    assert p["avg@8"] == 0.25 and p["maj@8"] == 0.0  # "6" wins 4 to 2 and is wrong
    assert p["pass@8"] == 1.0 and p["pass@2"] == pytest.approx(exact_pass_at_k(8, 2, 2), rel=1e-12)
    assert per_prompt([0.0, 1.0, 1.0], ["1", "2", "2"])["maj@3"] == 1.0
    assert "maj@3" not in per_prompt([0.0, 1.0, 1.0])


def test_summary_means_and_bootstrap_interval():
    rng = np.random.default_rng(0)
    prompts = [per_prompt(list(rng.random(4) < 0.3)) for _ in range(400)]
    out = summarize(prompts, seed=3)
    mean = np.mean([p["avg@4"] for p in prompts], dtype=np.float64)
    assert out["avg@4"] == pytest.approx(mean, rel=1e-12)
    assert out["avg@4_lo"] < mean < out["avg@4_hi"]
    se = np.std([p["avg@4"] for p in prompts]) / np.sqrt(400)  # the normal interval: +-1.96 standard errors
    assert out["avg@4_hi"] - out["avg@4_lo"] == pytest.approx(2 * 1.96 * se, rel=0.15)
    assert summarize(prompts, seed=3) == out  # seeded
    assert bootstrap_interval([1.0] * 5) == (1.0, 1.0)
    assert all(math.isnan(x) for x in bootstrap_interval([]))
