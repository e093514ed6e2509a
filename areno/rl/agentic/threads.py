"""One agent call on its own thread and event loop (``AgentThread``), so that a blocking call inside ``run_agent``
(``time.sleep``, a synchronous HTTP client) stalls only its own sample and ``--agent-timeout-s`` still fires: at the
deadline the rollout stops waiting, cancels the call's task on its loop (an ``await`` that hangs ends there) and
leaves a thread that is still blocked to finish on its own, counted in ``areno.training.plugins.stuck_calls``."""

from __future__ import annotations

import asyncio
import threading

from areno.training.plugins import stuck_calls


class AgentThread:
    """``await agent_fn(ctx, batch)`` on a daemon thread; ``outcome`` (an asyncio future of the caller's loop) gets
    ``("ok", value)`` or ``("raised", exception)``; ``abandon()`` gives up on it. ``ctx.aclose()`` runs on the call's
    own loop when it ends."""

    def __init__(self, agent_fn, ctx, batch):
        self._caller = asyncio.get_running_loop()
        self.outcome: asyncio.Future = self._caller.create_future()
        self._loop = self._task = None
        self._abandoned = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, args=(agent_fn, ctx, batch), name="areno-agent",
                                       daemon=True)
        self.thread.start()

    def _run(self, agent_fn, ctx, batch) -> None:
        try:
            outcome = ("ok", asyncio.run(self._call(agent_fn, ctx, batch)))
        except BaseException as e:  # noqa: BLE001 - a broken agent (even sys.exit()) costs its sample, not the run
            outcome = ("raised", e)
        try:
            self._caller.call_soon_threadsafe(self._resolve, outcome)
        except RuntimeError:  # the rollout's loop has ended: nobody waits for this call any more
            pass

    def _resolve(self, outcome) -> None:
        if not self.outcome.done():
            self.outcome.set_result(outcome)

    async def _call(self, agent_fn, ctx, batch):
        with self._lock:
            if self._abandoned:
                return None
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            return await agent_fn(ctx, batch)
        finally:
            await ctx.aclose()

    def abandon(self) -> None:
        """Stop waiting: cancel the call's task (it ends at its next ``await``) and count the thread as stuck while
        it lives."""
        with self._lock:
            self._abandoned = True
            loop, task = self._loop, self._task
        if loop is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop has just closed: the call ended
                pass
        stuck_calls.add(self.thread)
