"""The quickstart's task: two-digit addition, demonstrated by a sloppy teacher and checked by an exact verifier.

A prompt is one user message such as ``"47+85="``; the true answer is the sum, ``"132"``. Each training row's
``response`` is a *demonstration* from an imperfect teacher who, in a fixed fraction of its demonstrations
(``teacher_error``, 0.6 by default), forgets to carry: it writes each column's digit sum without the carry from the
column to its right, the classic ``47+85=122``. Problems whose units do not carry (about half) are demonstrated
correctly either way. The ``answer`` field, which the reward checks, is always the true sum.

So supervised fine-tuning on the demonstrations teaches the model the teacher's habit: on a carry problem it puts
about 60% of its probability on the wrong answer, and greedy decoding answers it wrong. Sampling still finds the
right answer about 40% of the time, and GRPO with the exact-match reward moves the probability there. The
quickstart shows exactly that: held-out accuracy rises from roughly the share of no-carry problems after the SFT
warm-up to nearly all problems after a few dozen RL steps.

Held-out rows carry ``split: "eval"`` and never share a problem with the training rows. The file is a plugin for
both flags:

- ``--dataset-loader-fn areno/quickstart/task.py``: ``load_training_dataset(path, ...)`` generates the rows. ``path``
  (``--dataset-path``) is optional; when given it is a comma-separated ``key=value`` spec of ``generate``'s
  arguments, e.g. ``--dataset-path "n_eval=100,teacher_error=0"``.
- ``--reward-fn-path areno/quickstart/task.py``: ``reward_fn(record)`` is 1.0 when the completion is exactly the sum
  (surrounding whitespace ignored), else 0.0.

Imports nothing from areno, so the plugin loader can import it by path anywhere.
"""

from __future__ import annotations

import random

DEFAULTS = dict(seed=0, digits=2, n_train=0, n_eval=200, teacher_error=0.6)


def true_sum(a: int, b: int) -> str:
    return str(a + b)


def carry_forgotten(a: int, b: int) -> str:
    """The sloppy teacher's sum: every column's digits added with no carry in, the leftmost column written in full
    (``47+85`` -> ``"12"`` then ``"2"`` -> ``"122"``)."""
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    cols = [int(da[i] if i < len(da) else 0) + int(db[i] if i < len(db) else 0) for i in range(width)]
    return str(cols[-1]) + "".join(str(c % 10) for c in reversed(cols[:-1]))


def carries(a: int, b: int) -> bool:
    """Whether the two answers differ: some column other than the leftmost carries."""
    return true_sum(a, b) != carry_forgotten(a, b)


def row(a: int, b: int, *, sloppy: bool = False) -> dict:
    answer = true_sum(a, b)
    return {"prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "response": carry_forgotten(a, b) if sloppy else answer, "answer": answer}


def generate(seed: int = 0, digits: int = 2, n_train: int = 0, n_eval: int = 200,
             teacher_error: float = 0.6) -> list[dict]:
    """Training rows then ``n_eval`` held-out rows over distinct pairs of ``digits``-digit operands (``n_train`` 0 =
    every pair not held out); a training row's demonstration forgets the carry with probability ``teacher_error``.
    The same arguments give the same rows."""
    if not 0.0 <= teacher_error <= 1.0:
        raise ValueError(f"teacher_error must be in [0, 1], got {teacher_error}")
    lo, hi = (10 ** (digits - 1) if digits > 1 else 0), 10**digits
    pairs = [(a, b) for a in range(lo, hi) for b in range(lo, hi)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    if n_eval >= len(pairs) or n_train + n_eval > len(pairs):
        raise ValueError(f"{n_train} training and {n_eval} held-out problems asked of {len(pairs)} distinct pairs")
    held_out, train = pairs[:n_eval], pairs[n_eval:]
    if n_train:
        train = train[:n_train]
    rows = [row(a, b, sloppy=rng.random() < teacher_error) for a, b in train]
    for a, b in held_out:
        rows.append({**row(a, b), "split": "eval"})
    return rows


def parse_spec(spec, defaults=None, task: str = "the quickstart task") -> dict:
    """``"n_eval=64,teacher_error=0.5"`` -> ``{"n_eval": 64, "teacher_error": 0.5}`` (keys of ``defaults``, by
    default ``generate``'s; empty or None -> {})."""
    defaults = DEFAULTS if defaults is None else defaults
    out = {}
    for item in str(spec or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in defaults:
            raise ValueError(f"--dataset-path for {task} takes key=value items with keys "
                             f"{', '.join(defaults)}; got {item!r}")
        out[key] = type(defaults[key])(value)
    return out


def load_training_dataset(path=None, *, default_loader=None, **kwargs) -> list[dict]:
    return generate(**{**DEFAULTS, **parse_spec(path)})


def reward_fn(record) -> float:
    return 1.0 if record["completion"].strip() == str(record["answer"]).strip() else 0.0
