"""Agentic rollout sent ahead (split mode, --max-staleness K > 0): the agent episodes of the next steps' batches run on
a background thread of train rank 0 while this step trains, as plain batches are sent ahead to the engines.

``AgentsAhead.send(shares)`` queues each upcoming batch's share (``AgentRollout.collect``, one batch after another on
one worker thread, each through the engines' token service under the policy they hold); ``take()`` hands the oldest
batch's result to its step. Every token an engine samples carries the policy version of that engine's weights (the
token service answers with it), so a multi-turn episode records per token which policy sampled it; the per-sample
staleness drop (``areno.rl.corrections.drop_stale``) and the corrections read them as for plain rows. ``wait()`` runs
before any other command reaches the engines (``RemoteRollout.background``): a policy sync waits for the batches in
flight to finish, so a turn is never split across two policies (--partial-rollout with --agent-fn is refused).

A checkpoint does not hold the episodes in flight: its data position is the first batch sent ahead (the loop's), so a
resumed run samples those batches again with the resumed policy.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor

THREAD = "areno-agents-ahead"


class AgentsAhead:
    """The batches of agent episodes sent ahead (``agent``: the ``AgentRollout``; ``n`` samples per prompt)."""

    def __init__(self, agent, n: int, reward_fn):
        self.agent, self.n, self.reward_fn = agent, n, reward_fn
        self.count = 0  # batches sent ahead and not yet taken (every train rank keeps it alike)
        self._pending = collections.deque()  # a Future per batch, oldest first
        self._pool = None

    def send(self, shares: list[list]) -> None:
        """Start this rank's share of each upcoming batch, oldest first (rank 0 runs the agents: the other ranks'
        shares are empty)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=THREAD)
        for mine in shares:
            self._pending.append(self._pool.submit(self.agent.collect, mine, self.n, self.reward_fn))
        self.count += len(shares)

    def take(self):
        """The oldest batch's ``AgentRollout.collect`` result (waiting for it), and the seconds waited."""
        t0 = time.perf_counter()
        out = self._pending.popleft().result()
        self.count -= 1
        return out, time.perf_counter() - t0

    def wait(self) -> None:
        """Every batch in flight finished (an agent that raised inside ``collect`` re-raises here); a no-op on the
        worker thread itself."""
        if threading.current_thread().name.startswith(THREAD):
            return
        for future in self._pending:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
