"""Chained decode: ``Engine.step(decode_steps=k)`` runs k decode steps in one go when a step only decodes (the
runner chains them on the device: one CUDA graph per bucket and k, sampling there) and gives each sequence up to k
tokens; a sequence that stops early keeps only its tokens up to the stop (the rest were computed and are dropped).

Lookahead (inside ``Engine.generate``, ``EngineConfig.lookahead``: on CUDA by default): when a k-step group is
launched and nothing that could be admitted waits, the next group of the same rows is queued right behind it, its
input tokens taken on the device from the first group's last step, before the host reads the first group's tokens;
the next ``Engine.step`` returns that group's tokens (queuing the one after it first). So the host's read-back, stop
checks and input packing overlap the device's decoding instead of leaving it idle between groups. A row that stops
in a group has already been queued for the next one: those tokens are dropped (the device work is wasted, nothing
else: the tokens and log-probs kept are those of the plain chain).

Hybrid models (recurrent-state slots) queue ahead like any model: a slot stays with its row while it runs, and a row
that stops in a chain still writes its slot in the one queued behind it, before any later sequence given that slot
prefills (stream order). Only a fork's pending state copy waits for a scheduled step. Speculation's gated chains
(``spec_gated``) use the same reservation, read-back and queue slot (``ahead``).
"""

from __future__ import annotations

import contextlib

from areno.engine.scheduler import Chunk, Step


class DecodeChains:
    """One engine's k-step decode groups and its lookahead queue (``Engine.chains``)."""

    def __init__(self, engine):
        self.engine = engine
        self.lookahead = False  # set by ``on`` (config.lookahead): a step may queue the next group early
        self.ahead = None  # a queued group whose tokens are not read yet: (rows, DecodeLaunch); spec_gated's own tuple

    @contextlib.contextmanager
    def on(self, decode_steps: int):
        """The lookahead for a stretch of ``Engine.step(decode_steps)`` calls driven by one loop (``Engine.generate``,
        partial rollout's ``run``): ``EngineConfig.lookahead``, by default on CUDA devices, where steps chain
        (``decode_steps`` > 1) or speculation's gated chains can queue. A group may still be queued after the
        stretch: the next step reads it (``drain`` reads it at once)."""
        e = self.engine
        want = e.config.lookahead
        if want is None:
            want = next(e.model.parameters()).device.type == "cuda"
        self.lookahead = want and (decode_steps > 1 or e.spec is not None)
        try:
            yield
        finally:
            self.lookahead = False

    def reserve(self, step: Step, rows: list, k: int, hold: bool = False) -> bool:
        """Whether ``step`` can run as k decode steps: decodes only, nothing waiting that could be admitted (unless
        ``hold``: waiting ones were admitted one step ago), no top log-probs or grammars (the host masks every token),
        every position inside the context, and the blocks of all k positions reserved (they are, when this says yes)."""
        e = self.engine
        if not step.is_decode or (e.scheduler.can_admit() and not hold):
            return False
        if any(s.options.top_logprobs or s.grammar is not None for s in rows):
            return False
        if any(len(s) + k - 1 > e.max_model_len for s in rows):
            return False
        return all(e.blocks.reserve_tokens(s, len(s) + k - 1) for s in rows)

    def run(self, step: Step, rows: list, k: int, copies, state_copies=()) -> list:
        """Launch ``step`` as k decode steps, queue the next group (lookahead), then read this one's tokens."""
        e = self.engine
        launch = e.runner.launch_decode_steps(step, rows, k, copies, state_copies)
        e.step_counts["chained"] += k
        self.queue_next(rows, launch, range(len(rows)))
        tokens, logprobs = e.runner.wait_decode(launch)
        e.keep_routing(step)
        return self.take(rows, tokens, logprobs)

    def step_ahead(self) -> list:
        """The queued group's tokens, after queuing the group after it for the rows still running."""
        rows, launch = self.ahead
        self.ahead = None
        live = [i for i, s in enumerate(rows) if not s.is_finished]
        if live:
            self.queue_next([rows[i] for i in live], launch, live)
        tokens, logprobs = self.engine.runner.wait_decode(launch)
        return self.take(rows, tokens, logprobs)

    def queue_next(self, rows: list, launch, index) -> None:
        """Lookahead: queue k more decode steps of ``rows`` (row i's input: row ``index[i]``'s last token of
        ``launch``, still on the device) when every row surely runs k more tokens and the blocks for them are
        there; else queue nothing (the next step schedules as usual)."""
        e, k = self.engine, launch.k
        if self.can_queue(rows, k):
            nxt = self.next_step(rows, k)
            self.ahead = (rows, e.runner.launch_decode_steps(nxt, rows, k, ids_from=(launch, list(index))))
            e.step_counts["chained"] += k
            e.step_counts["ahead"] += k

    def can_queue(self, rows: list, k: int) -> bool:
        """Whether the k steps after the group in flight (k unread tokens a row) can be queued now: the lookahead on,
        nothing waiting that fits, one rank, no per-group host work (routes, image offsets, a fork's state copy,
        penalty slots), every row surely running k more tokens inside the context; reserves their blocks when yes."""
        e = self.engine
        if not self.lookahead or e.scheduler.can_admit() or e.runner.tp_group is not None:
            return False
        if e.runner.record_routing or e.runner.images is not None or e.blocks.pending_state_copies:
            return False  # routes and image offsets are per group on the host; a fork's state copy waits for a schedule
        for s in rows:  # each has up to k unread tokens in the group in flight: the next group covers k after those
            if s.num_output + k >= s.options.max_new_tokens or len(s) + 2 * k - 1 > e.max_model_len:
                return False
        if any(s.options.adjusts_logits for s in rows):
            return False  # penalty slots are filled and released per group on the host
        return all(e.blocks.reserve_tokens(s, len(s) + 2 * k - 1) for s in rows)

    @staticmethod
    def next_step(rows: list, k: int) -> Step:
        """The decode step of ``rows`` queued behind a group of k in flight: each row's input is its last token."""
        return Step([Chunk(s, len(s) + k - 1, len(s) + k) for s in rows], is_decode=True)

    def take(self, rows: list, tokens, logprobs) -> list:
        """Append a k-step group's tokens ([k, rows] CPU) to its rows up to each one's stop; rows that finished
        before the group (queued ahead) drop theirs. Returns the rows that took tokens."""
        e = self.engine
        tokens, logprobs = tokens.t().tolist(), logprobs.t().tolist()  # [rows][k]
        appended, took = 0, []
        for seq, toks, lps in zip(rows, tokens, logprobs):
            if seq.is_finished:
                continue
            before = len(seq)
            reason = e.stopper.extend(seq, toks, lps)
            appended += len(seq) - before
            took.append(seq)
            e.scheduler.after_decode(seq)
            if reason is not None:
                seq.finish(reason)
                e.scheduler.finish(seq)
        e.note_progress(appended)
        return took

    def drain(self) -> None:
        """Read every group queued ahead (their tokens taken) and queue no more until the flag is set again."""
        lookahead, self.lookahead = self.lookahead, False
        while self.ahead is not None:
            self.engine.step()
        self.lookahead = lookahead
