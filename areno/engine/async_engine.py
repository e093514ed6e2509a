"""An asyncio front end on the engine: submit, stream and abort, for ``areno serve`` and agentic rollout.

One background thread owns the engine and runs its steps; requests and aborts reach it through a queue, so a request
that arrives while decode runs joins the running batch at the next step (continuous batching). Outputs leave the
engine thread once per step, as one batch per event loop (one ``call_soon_threadsafe`` per step, never per token);
on the loop each request's :class:`RequestStream` buffers its :class:`TokenEvent` items in a deque and wakes its
reader at most once per batch, so a reader that fell behind takes everything queued in one go (``pending``).
``areno serve`` runs the engine in its own process instead (``areno.serve.replicas``), with the same stream type.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass

from areno.config import SamplingParams
from areno.engine.engine import Engine

log = logging.getLogger("areno.engine")


@dataclass(slots=True)
class TokenEvent:
    index: int  # sample index within the request
    token_id: int | None
    logprob: float | None
    finish_reason: str | None = None
    stop_text: str | None = None
    top: list[tuple[int, float]] | None = None  # top candidates' (id, log-prob) when asked for


class RequestStream:
    """What :meth:`AsyncEngine.submit` returns: iterate for events; ``abort()`` frees the request's blocks.

    Events (or an exception, which ends the stream) arrive on the event loop through :meth:`put` / :meth:`put_many`
    (from another thread: :meth:`push`); they wait in a deque until read."""

    def __init__(self, owner, prompt_ids, options):
        self.owner, self.prompt_ids, self.options = owner, prompt_ids, options
        self.loop = asyncio.get_running_loop()
        self._events: deque = deque()
        self._waiter: asyncio.Future | None = None
        self.seqs = []
        self.mm = None  # the request's images (Engine.add_request's mm), set by submit
        self.final_only = False  # set by submit: events only when a sample finishes
        self.remaining = options.n
        self.error: BaseException | None = None
        self._deferred: BaseException | None = None

    # ---- producer side (on the event loop) ---------------------------------------------------------------
    def put(self, event) -> None:
        self._events.append(event)
        self._wake()

    def put_many(self, events) -> None:
        self._events.extend(events)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def push(self, event):
        """:meth:`put` from another thread."""
        self.loop.call_soon_threadsafe(self.put, event)

    # ---- consumer side -----------------------------------------------------------------------------------
    def pending(self) -> list[TokenEvent]:
        """The events already queued, taken without waiting: a consumer that fell behind sends them as one chunk.
        An error queued among them is raised by the next ``__anext__``, after the events before it."""
        out = []
        events = self._events
        while self._deferred is None and events:
            event = events.popleft()
            if isinstance(event, BaseException):
                self._deferred = event
                break
            if event.finish_reason is not None:
                self.remaining -= 1
            out.append(event)
        return out

    def abort(self):
        if self.remaining > 0:
            self.owner._commands.put(("abort", self))
            self.owner._wake.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self._deferred is not None:
            event, self._deferred = self._deferred, None
            self.remaining = 0
            raise event
        events = self._events
        if not events:
            if self.remaining <= 0:
                raise StopAsyncIteration
            while not events:
                self._waiter = self.loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        event = events.popleft()
        if isinstance(event, BaseException):
            self.remaining = 0
            raise event
        if event.finish_reason is not None:
            self.remaining -= 1
        return event


def deliver(batch) -> None:
    """On the event loop: ``[(stream, [events])]`` of one engine step into their streams."""
    for stream, events in batch:
        stream.put_many(events)


class AsyncEngine:
    """``decode_steps`` k > 1 lets a step that only decodes run k tokens in one go (``Engine.step``): each sequence
    then yields up to k events at once (agentic rollout uses the RL rollout's k; the server keeps 1). With k > 1 each
    step runs with the engine's lookahead (``DecodeChains.on``: on CUDA by default), as ``Engine.generate``'s do:
    while nothing that fits waits, the next group of k is queued before this one's tokens are read. A request that
    arrives then waits for that group (at most k steps) before it is admitted; one aborted meanwhile just drops its
    queued tokens (its blocks go to later steps, which the stream orders after the group's writes). With k = 1 (the
    server, whose ``ServeEngine`` runs calls on the engine between steps) nothing is queued between two steps.
    ``reopen_when_idle`` (the server's): the speculative gate's window restarts each time the engine runs dry
    (``SpecDecoder.reopen``); a rollout's windows are its own (``take_stats``), a function of its tokens."""

    reopen_when_idle = False

    def __init__(self, engine: Engine, decode_steps: int = 1):
        self.engine = engine
        engine.grammars.off_loop = True  # a new grammar compiles while the other requests decode
        self.decode_steps = decode_steps
        self._emitted: dict[int, int] = {}  # seq_id -> output tokens already sent
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[int, RequestStream] = {}  # seq_id -> stream
        self._thread = threading.Thread(target=self._loop, name="areno-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompt_ids: list[int], options: SamplingParams, *, mm=None,
                     final_only: bool = False) -> RequestStream:
        """Queue a request (``mm``: its images, as for :meth:`Engine.add_request`); a refusal ends the stream.
        ``final_only``: a sample's events arrive together when it finishes (a caller that wants whole outputs, such as
        agentic rollout, costs the event loop one wake-up per sample instead of one per engine step)."""
        stream = RequestStream(self, list(prompt_ids), options)
        stream.mm = mm
        stream.final_only = final_only
        self._commands.put(("add", stream))
        self._wake.set()
        return stream

    def shutdown(self, *, drain: bool = False, timeout: float = 30.0) -> None:
        """Stop the engine thread; with ``drain`` let in-flight requests finish first, else abort them."""
        self._commands.put(("shutdown", drain))
        self._wake.set()
        self._thread.join(timeout)

    def close(self) -> None:
        """Stop the engine thread (aborting what is in flight) and end the session, TP followers included."""
        if self._thread.is_alive():
            self.shutdown(drain=False)
        self.engine.close()

    @property
    def serving(self) -> bool:
        """Whether the engine thread runs (it ends on shutdown or when a step fails for good)."""
        return self._thread.is_alive()

    @property
    def num_active(self) -> int:
        return len(self._streams)

    # ---- engine thread -------------------------------------------------------------------------------------
    def _apply(self, cmd, arg) -> None:
        if cmd == "add":
            try:
                arg.seqs = self.engine.add_request(arg.prompt_ids, arg.options, mm=arg.mm)
            except Exception as exc:  # a request the engine refuses fails alone
                arg.push(exc)
                return
            for seq in arg.seqs:
                self._streams[seq.seq_id] = arg
        elif cmd == "abort":
            self.engine.abort(arg.seqs)
            for seq in arg.seqs:
                self._emitted.pop(seq.seq_id, None)
                if self._streams.pop(seq.seq_id, None) is not None:
                    arg.push(TokenEvent(seq.sample_index, None, None, "abort"))
        elif cmd == "shutdown":
            self._stop = True
            if not arg:
                for stream in {id(s): s for s in self._streams.values()}.values():
                    self._apply("abort", stream)

    def _loop(self) -> None:
        while True:
            while True:
                try:
                    cmd, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                self._apply(cmd, arg)
            if self._stop and not self.engine.has_work():
                return
            if not self.engine.has_work():
                if self.reopen_when_idle and self.engine.spec is not None:
                    self.engine.spec.reopen()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with self.engine.chains.on(self.decode_steps) if self.decode_steps > 1 else contextlib.nullcontext():
                    seqs = self.engine.step(self.decode_steps)
            except Exception as exc:  # keep serving: fail the requests in flight, not the process
                log.exception("engine step failed")
                self.engine.chains.ahead = None  # a group queued by the failed step is not read
                for stream in {id(s): s for s in self._streams.values()}.values():
                    self.engine.abort(stream.seqs)
                    stream.push(exc)
                self._streams.clear()
                continue
            batches: dict = {}  # event loop -> [(stream, events)]: one wake-up per loop per step, not per token
            for seq in seqs:
                stream = self._streams.get(seq.seq_id)
                if stream is None or (stream.final_only and not seq.is_finished):
                    continue
                start, end, p = self._emitted.get(seq.seq_id, 0), len(seq.tokens) - seq.prompt_len, seq.prompt_len
                events = [TokenEvent(seq.sample_index, seq.tokens[p + j], seq.logprobs[j], None, None,
                                     seq.top_logprobs[j] if seq.options.top_logprobs else None)
                          for j in range(start, end)]
                if seq.is_finished:
                    if not events:
                        events = [TokenEvent(seq.sample_index, None, None)]
                    events[-1].finish_reason, events[-1].stop_text = seq.finish_reason, seq.stop_text
                    del self._streams[seq.seq_id]
                    self._emitted.pop(seq.seq_id, None)
                else:
                    self._emitted[seq.seq_id] = end
                batches.setdefault(stream.loop, []).append((stream, events))
            for loop, batch in batches.items():
                try:
                    loop.call_soon_threadsafe(deliver, batch)
                except RuntimeError:  # that event loop is closed: nobody is listening
                    pass
