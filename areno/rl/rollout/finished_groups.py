"""The host work on a prompt group once all its samples have finished (the completions' texts, their reward
records and scores, the rows' tensors for the update), done on a background thread while the engine still decodes the
other prompts. The colocated engine reports each group as it finishes (``Engine.generate(on_finished=...)``); the
groups it did not report (split mode, followers of a TP group) are handed over when the rollout returns.

The results are those of doing everything after the rollout, in order: each sample's record has the same text and
index (``group * n + sample``, its place in this rank's batch), each reward comes from one call of the user's function
through ``rewards.score`` (an exception, timeout or non-number costs that sample alone), and the tensors hold the
values of the rows' lists. Only the order of the reward calls follows the order in which groups finish. Groups
reaching the worker after the decode has ended are not tensorised here: pack() converts those rows one microbatch at
a time, where all but the first conversion hide behind the device's work on the previous microbatch.

While the worker may run user Python the interpreter's thread switch interval is lowered to ``SWITCH_INTERVAL_S``
(restored by ``close``): the engine thread releases the GIL at every torch call and waits on the device without it;
with the default 5 ms a CPU-bound reward function would hold the GIL that long before each of those calls returned,
stalling the decode loop for more than the overlap saves.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

from areno.rl.rewards import completion_texts, record_from, score
from areno.training.batch import row_tensors

SWITCH_INTERVAL_S = 5e-5
_switch = {"users": 0, "saved": None}  # rollouts running now (threads of an SDK user may run several at once)
_switch_lock = threading.Lock()


def _lower_switch_interval() -> None:
    with _switch_lock:
        if _switch["users"] == 0:
            _switch["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch["saved"], SWITCH_INTERVAL_S))
        _switch["users"] += 1


def _restore_switch_interval() -> None:
    with _switch_lock:
        _switch["users"] -= 1
        if _switch["users"] == 0:
            sys.setswitchinterval(_switch["saved"])


class FinishedGroups:
    """Score and tensorise this rank's prompt groups (``prompts``: the Prompts given to the engine, in order;
    ``group_size``: samples per prompt) as they finish. ``add`` is the engine's callback, ``finish`` collects."""

    def __init__(self, prompts: list, group_size: int, tokenizer, reward_fn, *, timeout_s: float | None = None):
        self.prompts, self.n = prompts, group_size  # areno.training.data.Prompt
        self.tokenizer, self.reward_fn, self.timeout_s = tokenizer, reward_fn, timeout_s
        self.rewards: list[list[float] | None] = [None] * len(prompts)
        self.tensors: list[list | None] = [None] * len(prompts)  # per group: (ids_tensor, logprobs_tensor) per sample
        self.failures = 0
        self.early_groups = 0  # groups scored while the engine still decoded
        self.spans: list[tuple[float, float]] = []  # the worker's busy intervals (perf_counter)
        self.decode_end: float | None = None
        self._reported: set[int] = set()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        _lower_switch_interval()
        self._thread = threading.Thread(target=self._work, name="finished-groups", daemon=True)
        self._thread.start()

    def add(self, i: int, completions: list) -> None:
        """Group ``i`` has finished (called on the engine's thread: only queues it)."""
        self._reported.add(i)
        self._queue.put((i, completions))

    def finish(self, results: list[list]) -> tuple[list[list[float]], int, list[list | None]]:
        """After the rollout (``results``: every group's completions): queue the groups not reported yet, wait for
        the worker; returns the rewards per group, the number of failed samples and the tensors per group (None for a
        group the worker reached after the decode)."""
        self.decode_end = time.perf_counter()
        for i, completions in enumerate(results):
            if i not in self._reported:
                self.add(i, completions)
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.rewards, self.failures, self.tensors

    def close(self) -> None:
        """Stop the worker (if ``finish`` did not run: the rollout failed) and restore the switch interval."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        _restore_switch_interval()

    @property
    def busy_s(self) -> float:
        """The worker's time on groups."""
        return sum(b - a for a, b in self.spans)

    @property
    def overlap_s(self) -> float:
        """The part of it done while the engine still decoded (off the step's critical path)."""
        end = self.decode_end if self.decode_end is not None else time.perf_counter()
        return sum(max(0.0, min(b, end) - a) for a, b in self.spans)

    def _work(self) -> None:
        try:
            while True:
                batch = [self._queue.get()]
                while True:  # everything queued so far in one go: one decode_batch, one score call
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = None in batch
                batch = [b for b in batch if b is not None]
                if batch:
                    self._process(batch)
                if stop:
                    return
        except BaseException as e:  # noqa: BLE001 - re-raised on the loop's thread by finish()
            self._error = e

    def _process(self, batch: list[tuple[int, list]]) -> None:
        t0 = time.perf_counter()
        early = self.decode_end is None
        completions = [c for _, group in batch for c in group]
        texts = iter(completion_texts(self.tokenizer, completions))
        records = [record_from(self.prompts[i].row, next(texts), c.token_ids, i * self.n + j)
                   for i, group in batch for j, c in enumerate(group)]
        rewards, failures = score(self.reward_fn, records, timeout_s=self.timeout_s)
        at = 0
        for i, group in batch:
            self.rewards[i] = rewards[at : at + len(group)]
            at += len(group)
            if early:
                self.tensors[i] = [row_tensors(self.prompts[i].ids, c.token_ids, c.logprobs) for c in group]
        self.failures += failures
        self.early_groups += len(batch) if early else 0
        self.spans.append((t0, time.perf_counter()))
