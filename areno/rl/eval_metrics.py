"""Evaluation metrics as papers report them: avg@K (mean pass@1), the unbiased pass@k, maj@K, bootstrap intervals.

Every metric is a mean over prompts of a per-prompt value computed from that prompt's K samples:

- ``avg@K``: the fraction of the prompt's samples that are correct (a sample is correct when its score is > 0.5, so
  a 0/1 reward counts as it is and a graded one is thresholded);
- ``pass@k`` for k = 1, 2, 4, ... K: the unbiased estimator of Chen et al. (2021), ``1 - C(n-c, k) / C(n, k)`` for
  ``n`` samples of which ``c`` are correct, computed in the numerically stable product form
  ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (no factorials, no overflow at n = 1024);
- ``maj@K``: whether the majority answer is correct. Answers are the strings the reward file's
  ``extract_answer(completion)`` returns (``None``: the sample has no answer and does not vote). The winner is the
  answer with the most votes; a tie goes to the tied answer that appeared first in sample order (sample 0, 1, ...),
  so the same samples always give the same vote. The prompt scores 1 when the first sample holding the winning
  answer is correct, 0 when no sample has an answer.

Intervals are percentile bootstrap 95% intervals over prompts: the per-prompt values are resampled with replacement
``B`` times from a seeded generator and the 2.5th / 97.5th percentiles of the resampled means are reported.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

CORRECT = 0.5  # a sample scoring above this is correct
BOOTSTRAP_SAMPLES = 1000


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples with ``c`` correct (``k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def ks_for(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to ``n``, and ``n`` itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def majority(answers: list) -> int | None:
    """The index of the first sample holding the majority answer (ties: the answer seen first); None if no sample
    has an answer."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(i for i, a in enumerate(answers) if a is not None and votes[a] == top)


def per_prompt(scores: list[float], answers: list | None = None) -> dict[str, float]:
    """One prompt's values: avg@K, pass@k for every k of ``ks_for(K)``, and maj@K when ``answers`` are given."""
    n = len(scores)
    c = sum(s > CORRECT for s in scores)
    out = {f"avg@{n}": c / n}
    out.update({f"pass@{k}": pass_at_k(n, c, k) for k in ks_for(n)})
    if answers is not None:
        winner = majority(answers)
        out[f"maj@{n}"] = 0.0 if winner is None else float(scores[winner] > CORRECT)
    return out


def bootstrap_interval(values, *, seed: int = 0, samples: int = BOOTSTRAP_SAMPLES,
                       level: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of ``values`` (resampled with replacement, seeded)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(samples, values.size))].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def summarize(prompts: list[dict], *, seed: int = 0) -> dict[str, float]:
    """Dataset metrics from ``per_prompt`` values: each metric's mean and its ``_lo`` / ``_hi`` interval bounds."""
    out: dict[str, float] = {}
    if not prompts:
        return out
    for name in prompts[0]:
        values = [p[name] for p in prompts]
        out[name] = float(np.mean(values))
        out[f"{name}_lo"], out[f"{name}_hi"] = bootstrap_interval(values, seed=seed)
    return out


def metric_names(metrics: dict) -> list[str]:
    """The metric names of a ``summarize`` result (its interval bounds left out), in order."""
    return [k for k in metrics if not k.endswith(("_lo", "_hi"))]
