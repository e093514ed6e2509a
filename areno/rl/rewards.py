"""Scoring completions with the user's ``reward_fn(record) -> float``.

A reward function that raises (``SystemExit`` and ``KeyboardInterrupt`` included: user code cannot end the run), runs
longer than ``timeout_s``, or returns something that is not a finite float (a string, NaN, inf, ``10**400``) costs
that one sample (reward 0.0), is
counted in ``failures`` (logged by the loop as ``reward_failures``) and logs its traceback once per distinct exception
type and location, at WARNING; it never stops the run by itself (the loop stops a run whose rewards all fail for
``--max-reward-failure-steps`` steps in a row).

Calls run on daemon worker threads, so a real Ctrl-C still reaches the main thread and a hung call can be abandoned:
its sample is scored as a failure at the deadline, its thread is left to finish (or not) on its own and a fresh
worker takes its place; a late result is discarded. Abandoned threads are counted while they live
(``areno.training.plugins.stuck_calls``): with ``STUCK_CALL_LIMIT`` of them no further call starts (those samples
fail) and the loop stops the run, so a hanging reward cannot leak threads without bound.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field, fields
from typing import Any

from areno.training.plugins import stuck_calls

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


def user_fields(row: dict) -> dict:
    """The dataset row as the user wrote it: internal ``_``-keys left out (what a reward or agent sees)."""
    return {k: v for k, v in row.items() if not (isinstance(k, str) and k.startswith("_"))}


def record_from(row: dict, completion: str, tokens, index: int) -> RewardRecord:
    """A record for ``completion`` sampled from ``row``'s prompt; internal ``_``-keys of the row are left out."""
    source = user_fields(row)
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


def completion_texts(tokenizer, completions) -> list[str]:
    """The text each completion is scored on: the engine's own (cut at a stop string) where it has one, else the
    decode of its token ids without special tokens. A transformers ``TokenizersBackend`` with the library's own
    decode and no space clean-up decodes them all in one ``decode_batch`` call (Rust threads, outside the GIL), which
    gives exactly ``tokenizer.decode``'s strings; any other tokenizer decodes one by one."""
    texts = [c.text for c in completions]
    todo = [i for i, t in enumerate(texts) if t is None]
    ids = [list(completions[i].token_ids) for i in todo]
    backend = _plain_backend(tokenizer) if len(ids) > 1 else None
    if backend is not None:
        decoded = backend.decode_batch(ids, skip_special_tokens=True)
    else:
        decoded = [tokenizer.decode(x, skip_special_tokens=True) for x in ids]
    for i, t in zip(todo, decoded):
        texts[i] = t
    return texts


def _plain_backend(tokenizer):
    """The Rust tokenizer behind ``tokenizer`` when ``tokenizer.decode(ids, skip_special_tokens=True)`` is exactly
    its ``decode``: transformers' TokenizersBackend, neither decode method overridden, no clean-up of spaces."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not TokenizersBackend._decode:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if hasattr(backend, "decode_batch") else None


def _first(d: dict, *keys):
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def score(reward_fn, records, *, workers: int = 1, timeout_s: float | None = None) -> tuple[list[float], int]:
    """Rewards for ``records`` (in order) and how many samples failed (raised, timed out after ``timeout_s`` seconds
    of one call, or returned a non-finite/non-number), scored by ``workers`` threads. A timed-out call's thread is
    abandoned (counted in ``stuck_calls`` while it lives); with ``STUCK_CALL_LIMIT`` of them stuck the samples not
    yet started fail without a call."""
    records = list(records)
    n = len(records)
    rewards, ok = [0.0] * n, [False] * n
    todo: queue.SimpleQueue = queue.SimpleQueue()
    done: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(n):
        todo.put(i)
    running: dict[int, tuple[float, threading.Thread]] = {}  # sample index -> when its call started, on which thread
    lock = threading.Lock()

    def work():
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            with lock:
                running[i] = (time.monotonic(), threading.current_thread())
            done.put((i, _score_one(reward_fn, records[i])))
            with lock:
                if i in abandoned:  # its call came back late: this thread ends with it
                    return

    abandoned: set[int] = set()

    def start_worker():
        threading.Thread(target=work, name="reward", daemon=True).start()

    blocked = stuck_calls.full()
    for _ in range(0 if blocked else min(max(1, workers), n)):
        start_worker()
    finished = _give_up(todo, reward_fn) if blocked else 0
    while finished < n:
        with lock:
            oldest = min((t0 for t0, _ in running.values()), default=None)
        wait = 0.5 if timeout_s is None or oldest is None else oldest + timeout_s - time.monotonic()
        try:
            i, (value, good) = done.get(timeout=max(0.01, wait))
            with lock:
                late = running.pop(i, None) is None
            if not late:
                rewards[i], ok[i] = value, good
                finished += 1
        except queue.Empty:
            pass
        if timeout_s is not None:
            finished += _expire(running, abandoned, lock, timeout_s, reward_fn, records, start_worker, todo)
    return rewards, sum(not x for x in ok)


def _expire(running, abandoned, lock, timeout_s, reward_fn, records, start_worker, todo) -> int:
    """Abandon the calls running past ``timeout_s`` (their samples fail) and start a worker in each one's place (or,
    with too many stuck, fail the samples not started yet); returns how many samples that finished."""
    now = time.monotonic()
    with lock:
        expired = [(i, thread) for i, (t0, thread) in running.items() if now - t0 > timeout_s]
        for i, _ in expired:
            del running[i]
            abandoned.add(i)
    finished = 0
    for i, thread in expired:  # the thread keeps the call; a new worker takes the rest of the queue
        finished += 1
        stuck_calls.add(thread)
        if _first_time(("timeout", getattr(reward_fn, "__module__", None), getattr(reward_fn, "__qualname__", None))):
            log.warning("reward function did not return within --reward-timeout-s %gs on sample %s: scored 0.0 and "
                        "counted as a failure; the call is left running on a background thread (later timeouts are "
                        "counted, not logged)", timeout_s, getattr(records[i], "index", i))
        if stuck_calls.full():
            finished += _give_up(todo, reward_fn)
        else:
            start_worker()
    return finished


def _give_up(todo, reward_fn) -> int:
    """Fail the samples still queued (too many calls stuck); returns how many."""
    count = 0
    while True:
        try:
            todo.get_nowait()
        except queue.Empty:
            break
        count += 1
    if count and _first_time(("stuck", getattr(reward_fn, "__module__", None))):
        log.warning("%d reward calls are stuck past --reward-timeout-s (the limit): the remaining %d samples are "
                    "scored 0.0 without a call and the run stops after this step", stuck_calls.count(), count)
    return count


def _score_one(reward_fn, record) -> tuple[float, bool]:
    try:
        value = reward_fn(record)
        reward = reward_value(value)
    except BaseException as e:  # noqa: BLE001 - a user's bug (even sys.exit()) costs the sample, not the run
        frame = traceback.extract_tb(e.__traceback__, limit=10_000)[-1] if e.__traceback__ else None
        where = (frame.filename, frame.lineno) if frame else ("?", 0)
        if _first_time((type(e).__qualname__, *where)):
            log.warning("reward function raised on sample %s (scored 0.0; later %s at %s:%d are counted, not logged)"
                        "\n%s", getattr(record, "index", "?"), type(e).__name__, *where,
                        "".join(traceback.format_exception(e)).rstrip())
        return 0.0, False
    if reward is None:
        kind = "non-number" if not _numeric(value) else "non-finite"
        if _first_time((kind, getattr(reward_fn, "__module__", None), getattr(reward_fn, "__qualname__", None))):
            log.warning("reward function returned %s (%s) on sample %s: scored 0.0 and counted as a failure "
                        "(later %s returns are counted, not logged)", shown(value), type(value).__name__,
                        getattr(record, "index", "?"), kind)
        return 0.0, False
    return reward, True


def _numeric(value) -> bool:
    return not isinstance(value, (str, bytes)) and hasattr(value, "__float__")


def reward_value(value) -> float | None:
    """``value`` as a reward: a finite float, or None for anything else (a string, NaN, inf, an int too large for a
    float such as ``10**400``, a tensor of several elements, an object whose ``__float__`` raises)."""
    if not _numeric(value):
        return None
    try:
        x = float(value)
    except Exception:  # noqa: BLE001 - OverflowError, a tensor's RuntimeError, a user type's own error
        return None
    return x if math.isfinite(x) else None


def shown(value, limit: int = 80) -> str:
    """``repr(value)`` for a log line: cut to ``limit`` characters, and never raising."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user object whose __repr__ fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_time(key) -> bool:
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True
