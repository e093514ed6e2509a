"""Scoring completions with the user's ``reward_fn(record) -> float``.

A reward function that raises (``SystemExit`` and ``KeyboardInterrupt`` included: user code cannot end the run), runs
longer than ``timeout_s``, or returns something that is not a finite number costs that one sample (reward 0.0), is
counted in ``failures`` (logged by the loop as ``reward_failures``) and logs its traceback once per distinct exception
type and location, at WARNING; it never stops the run by itself (the loop stops a run whose rewards all fail for
``--max-reward-failure-steps`` steps in a row).

Calls run on daemon worker threads, so a real Ctrl-C still reaches the main thread and a hung call can be abandoned:
its sample is scored as a failure at the deadline, its thread is left to finish (or not) on its own and a fresh
worker takes its place; a late result is discarded.
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
    of one call, or returned a non-finite/non-number), scored by ``workers`` threads."""
    records = list(records)
    n = len(records)
    rewards, ok = [0.0] * n, [False] * n
    todo: queue.SimpleQueue = queue.SimpleQueue()
    done: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(n):
        todo.put(i)
    running: dict[int, float] = {}  # sample index -> when its call started
    lock = threading.Lock()

    def work():
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            with lock:
                running[i] = time.monotonic()
            done.put((i, _score_one(reward_fn, records[i])))

    def start_worker():
        threading.Thread(target=work, name="reward", daemon=True).start()

    for _ in range(min(max(1, workers), n)):
        start_worker()
    finished = 0
    while finished < n:
        with lock:
            oldest = min(running.values(), default=None)
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
        if timeout_s is None:
            continue
        now = time.monotonic()
        with lock:
            expired = [i for i, t0 in running.items() if now - t0 > timeout_s]
            for i in expired:
                del running[i]
        for i in expired:  # abandoned: the thread keeps the call, a new worker takes the rest of the queue
            finished += 1
            if _first_time(("timeout", getattr(reward_fn, "__module__", None),
                            getattr(reward_fn, "__qualname__", None))):
                log.warning("reward function did not return within --reward-timeout-s %gs on sample %s: scored 0.0 "
                            "and counted as a failure; the call is left running on a background thread (later "
                            "timeouts are counted, not logged)", timeout_s, getattr(records[i], "index", i))
            start_worker()
    return rewards, sum(not x for x in ok)


def _score_one(reward_fn, record) -> tuple[float, bool]:
    try:
        value = reward_fn(record)
    except BaseException as e:  # noqa: BLE001 - a user's bug (even sys.exit()) costs the sample, not the run
        frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        where = (frame.filename, frame.lineno) if frame else ("?", 0)
        if _first_time((type(e).__qualname__, *where)):
            log.warning("reward function raised on sample %s (scored 0.0; later %s at %s:%d are counted, not logged)"
                        "\n%s", getattr(record, "index", "?"), type(e).__name__, *where,
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
