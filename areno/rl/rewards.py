"""Scoring completions with the user's ``reward_fn(record) -> float``.

A reward function that raises, or returns something that is not a finite number, costs that one sample (reward 0.0),
is counted in ``failures`` (logged by the loop as ``reward_failures``) and logs its traceback once per distinct
exception type and location, at WARNING; it never stops the run.
"""

from __future__ import annotations

import logging
import math
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

log = logging.getLogger("areno.rewards")

_seen: set = set()  # (exception type, file, line) or (problem kind, function) already logged
_seen_lock = threading.Lock()


@dataclass
class RewardRecord:
    """One completion to score. ``record.completion`` and ``record["completion"]`` both work; other keys fall back
    to the source row (``record["question"]``)."""

    prompt: Any
    completion: str
    answer: Any = None
    solutions: list = field(default_factory=list)
    tokens: list = field(default_factory=list)  # completion token ids
    row: dict = field(default_factory=dict)  # the dataset row this prompt came from
    index: int = 0  # position in the scored batch

    def __getitem__(self, key):
        if key in _FIELDS:
            return getattr(self, key)
        if key in self.row:
            return self.row[key]
        raise KeyError(key)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key) -> bool:
        return key in _FIELDS or key in self.row

    def keys(self):
        return list(_FIELDS) + [k for k in self.row if k not in _FIELDS]


_FIELDS = tuple(f.name for f in fields(RewardRecord))


def record_from(row: dict, completion: str, tokens, index: int) -> RewardRecord:
    """A record for ``completion`` sampled from ``row``'s prompt; internal ``_``-keys of the row are left out."""
    source = {k: v for k, v in row.items() if not (isinstance(k, str) and k.startswith("_"))}
    answer = _first(source, "answer", "ground_truth")
    solutions = None
    for key in ("solutions", "solution", "ground_truth"):
        if source.get(key) is not None:
            value = source[key]
            solutions = list(value) if isinstance(value, (list, tuple)) else [value]
            break
    if solutions is None:
        solutions = [answer] if answer is not None else []
    if answer is None and solutions:
        answer = solutions[0]
    return RewardRecord(prompt=source.get("prompt"), completion=completion, answer=answer, solutions=solutions,
                        tokens=list(tokens) if tokens is not None else [], row=source, index=index)


def _first(d: dict, *keys):
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def score(reward_fn, records, *, workers: int = 1) -> tuple[list[float], int]:
    """Rewards for ``records`` and how many samples failed (raised, or returned a non-finite/non-number)."""
    records = list(records)
    if workers > 1 and len(records) > 1:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward") as pool:
            results = list(pool.map(lambda r: _score_one(reward_fn, r), records))
    else:
        results = [_score_one(reward_fn, r) for r in records]
    return [r for r, _ in results], sum(not ok for _, ok in results)


def _score_one(reward_fn, record) -> tuple[float, bool]:
    try:
        value = reward_fn(record)
    except Exception as e:  # noqa: BLE001 - a user's bug costs the sample, not the run
        frame = traceback.extract_tb(e.__traceback__)[-1]
        if _first_time((type(e).__qualname__, frame.filename, frame.lineno)):
            log.warning("reward function raised on sample %s (scored 0.0; later %s at %s:%d are counted, not logged)"
                        "\n%s", getattr(record, "index", "?"), type(e).__name__, frame.filename, frame.lineno,
                        "".join(traceback.format_exception(e)).rstrip())
        return 0.0, False
    reward = _as_float(value)
    if reward is None:
        kind = "non-number" if not _numeric(value) else "non-finite"
        if _first_time((kind, getattr(reward_fn, "__module__", None), getattr(reward_fn, "__qualname__", None))):
            log.warning("reward function returned %r (%s) on sample %s: scored 0.0 and counted as a failure "
                        "(later %s returns are counted, not logged)", value, type(value).__name__,
                        getattr(record, "index", "?"), kind)
        return 0.0, False
    return reward, True


def _numeric(value) -> bool:
    return not isinstance(value, (str, bytes)) and hasattr(value, "__float__")


def _as_float(value) -> float | None:
    if not _numeric(value):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor with several elements
        return None
    return x if math.isfinite(x) else None


def _first_time(key) -> bool:
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True
