"""The responses ``/v1/responses`` keeps (``store: true``, the default) for ``GET`` / ``DELETE`` and
``previous_response_id``: in memory, at most ``--responses-store-max`` of them, each for at most ``MAX_AGE_S``
seconds; the oldest go first."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX = 1000
MAX_AGE_S = 3600.0


@dataclass
class Stored:
    response: dict  # the Response object as returned
    messages: list[dict]  # the whole conversation up to and including its answer, as chat messages
    at: float


class ResponseStore:
    def __init__(self, max_count: int = DEFAULT_MAX, max_age_s: float = MAX_AGE_S, clock=time.monotonic):
        self.max_count, self.max_age_s, self.clock = max_count, max_age_s, clock
        self.entries: OrderedDict[str, Stored] = OrderedDict()

    def _expire(self) -> None:
        cutoff = self.clock() - self.max_age_s
        while self.entries and next(iter(self.entries.values())).at < cutoff:
            self.entries.popitem(last=False)

    def put(self, response: dict, messages: list[dict]) -> None:
        self._expire()
        self.entries[response["id"]] = Stored(response, messages, self.clock())
        while len(self.entries) > self.max_count:
            self.entries.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        self._expire()
        return self.entries.get(rid)

    def delete(self, rid: str) -> bool:
        self._expire()
        return self.entries.pop(rid, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self.entries)
