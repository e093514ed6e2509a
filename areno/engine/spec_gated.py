"""Speculation's gated stretches (``spec_decode``): while the gate keeps a batch plain, its steps run as chains of
plain decode steps, as a plain engine's multi-step decode does, instead of one step per scheduling round.

A gated step of decodes only that more gated steps follow runs ``k`` chained decode steps (the runner's
``launch_decode_steps``: one CUDA graph per bucket and k, sampling on the device), ``k`` from ``CHAIN_LENGTHS`` and
never past the step after which the gate would lift (the sequences that reach max_new_tokens in between counted; one
that stops earlier on a stop token only ends its own tokens, as in a plain chain). The graph keeps each step's final
hidden rows (``ModelRunner.keep_hidden``, a ``[k, rows, H]`` buffer): they are held for the deferred MTP catch-up
(``DeferredCatchUp.hold``, k rows a sequence), copied out of the graph's buffer before the next replay, so the draft
K/V of every position a chain computed is written later exactly as after k single gated steps. A sequence sure to
reach max_new_tokens before the gate lifts (``finish_gated``) will never draft again: its rows are not held, and a
chain of only such rows is a plain chain keeping no hidden rows (R1's 256 equal rollouts: no catch-up at all; such a
sequence turns blind, drafting no more, in case preemption lifts the gate before it ends). With the engine's
lookahead (``generate()``, ``EngineConfig.lookahead``: on CUDA by default) the next gated chain is queued before the
host reads the one in flight, as ``DecodeChains.queue_next`` does for a plain engine, when all its k steps stay
gated and every row surely runs them; each chain's hidden rows are copied on the stream right behind it, before the
queued chain replays into the same buffer. Not chained (a single gated step, ``spec_graphs``' width-1 forward):
under TP (the held rows are the leader's), with routing capture, with requests waiting that fit, or fewer than 2
steps before the gate lifts.
"""

from __future__ import annotations

from itertools import product

import torch

from areno.engine.decode_graphs import graph_key
from areno.engine.scheduler import Chunk, Step
from areno.engine.sequence import Status
from areno.engine.spec_exec import FinishWork

GATED_CHAIN = 8  # decode steps a gated stretch chains per round (as the rollout's --decode-steps default)
CHAIN_LENGTHS = (GATED_CHAIN, 4, 2)  # shorter chains before the gate lifts (one decode graph per length and bucket)


def chain_length(spec, step: Step) -> int:
    """How many plain decode steps the gated ``step`` chains (0: it runs alone): the longest of ``CHAIN_LENGTHS``
    whose steps are all gated; decodes only, one rank, no routing capture, and the blocks of every position
    reserved (``DecodeChains.reserve``: nothing waiting that fits, every position inside the context)."""
    e = spec.engine
    if not step.is_decode or e.runner.tp_group is not None or e.runner.record_routing:
        return 0
    seqs = [c.seq for c in step.chunks]
    most = steps_gated(spec, seqs)
    k = next((k for k in CHAIN_LENGTHS if k <= most), 0)
    return k if k and e.chains.reserve(step, seqs, k) else 0


def steps_gated(spec, seqs: list, unread: int = 0) -> int:
    """How many decode steps of ``seqs`` surely stay gated (more than the gate's limit still decoding through each:
    fewer than n - limit of them reach max_new_tokens before it), after ``unread`` tokens a row not read yet (a
    chain in flight); 0 when the batch is not above the limit."""
    limit = spec.limit  # constant through gated steps: they verify nothing
    if limit is None or len(seqs) <= limit:
        return 0
    left = sorted(s.options.max_new_tokens - s.num_output - unread for s in seqs)
    return left[len(seqs) - limit - 1]


def gated_chain(spec, step: Step, copies, state_copies, k: int) -> list:
    """``k`` plain decode steps of every sequence of ``step``, as ``DecodeChains.run``; each step's hidden rows
    held for the MTP catch-up. Returns the sequences that took tokens."""
    e = spec.engine
    r, seqs = e.runner, [c.seq for c in step.chunks]
    r.spec_exec.copy_draft_blocks(r, copies)
    never = finish_gated(spec)
    launch, hidden = _launch(r, step, seqs, k, copies, state_copies, keep=_keeps(seqs, never))
    spec.count(spec_gated_steps=k - 1)  # the gate counted the first
    _queue_next(spec, seqs, launch, range(len(seqs)))
    return _finish(spec, step.chunks, seqs, launch, hidden, never)


def finish_gated(spec) -> set[int]:
    """The decoding sequences that surely finish (reach max_new_tokens) before the gate lifts: their catch-up is
    never needed, so their hidden rows are not held (``DeferredCatchUp.hold``'s ``never``). A row's tokens not read
    yet shift its tokens left and the gated steps alike, so the running counts decide, and the set a chain is
    launched with still holds when its tokens are read (arrivals can only add to it)."""
    e = spec.engine
    decoding = [s for s in e.scheduler.running if s.num_computed >= len(s) - 1]
    gated = steps_gated(spec, decoding)
    return {s.seq_id for s in decoding if s.options.max_new_tokens - s.num_output <= gated}


def _keeps(seqs: list, never: set[int]) -> bool:
    """Whether a gated chain of ``seqs`` keeps its hidden rows: some row may still draft after the gate lifts."""
    return any(s.seq_id not in never for s in seqs)


def step_ahead(spec) -> list:
    """The gated chain queued ahead (``Engine.chains.ahead``): the one after it queued first for the rows still running,
    then its tokens read and its hidden rows held, as ``gated_chain``."""
    e = spec.engine
    seqs, launch, hidden, chunks, never = e.chains.ahead
    e.chains.ahead = None
    live = [i for i, s in enumerate(seqs) if not s.is_finished]
    if live:
        _queue_next(spec, [seqs[i] for i in live], launch, live)
    return _finish(spec, chunks, seqs, launch, hidden, never)


def _launch(r, step: Step, seqs: list, k: int, copies=(), state_copies=(), ids_from=None, keep: bool = True):
    """Queue a chain keeping its hidden rows (``keep``; else a plain chain); returns the launch and a copy of its
    rows ``[k, rows, H]`` made on the stream right behind it (a chain queued ahead replays the same graph, into the
    same buffer), None without ``keep``."""
    r.keep_hidden = keep
    try:
        launch = r.launch_decode_steps(step, seqs, k, copies, state_copies, ids_from=ids_from)
    finally:
        r.keep_hidden = False
    return launch, r.last_hidden.clone() if keep else None


def _queue_next(spec, seqs: list, launch, index) -> None:
    """Lookahead (``DecodeChains.queue_next``'s, for gated chains): queue the next ``k`` gated steps of ``seqs``
    (row i's input: row ``index[i]``'s last token of ``launch``, on the device) when every row surely runs k more
    tokens, all k steps stay gated (more than the gate's limit still decode through them) and their blocks are
    there."""
    e, k = spec.engine, launch.k
    if e.blocks.pending_copies:
        return  # a draft block copy waits for a scheduled step
    if steps_gated(spec, seqs, unread=k) < k or not e.chains.can_queue(seqs, k):
        return
    nxt = e.chains.next_step(seqs, k)
    never = finish_gated(spec)
    launch2, hidden = _launch(e.runner, nxt, seqs, k, ids_from=(launch, list(index)), keep=_keeps(seqs, never))
    spec.count(spec_gated_steps=k)
    e.step_counts["ahead"] += k  # its "chained" count comes when its tokens are read (``_finish``)
    e.chains.ahead = (seqs, launch2, hidden, nxt.chunks, never)


def _finish(spec, chunks, seqs: list, launch, hidden, never: set[int]) -> list:
    """A chain's tokens taken up to each row's stop and its hidden rows held (``DeferredCatchUp.hold``); returns the
    sequences that took tokens."""
    e, r, k = spec.engine, spec.engine.runner, launch.k
    tokens, logprobs = r.wait_decode(launch)
    r.spec_exec.last = (hidden, None, None)  # FinishWork's "hold" takes k rows a sequence out of it
    e.step_counts["chained"] += k
    took = e.chains.take(seqs, tokens, logprobs)
    ops = spec.deferred.take_drops()
    spec.deferred.hold(chunks, ops, k, never)  # without hidden rows every row is in ``never``
    with torch.inference_mode():
        spec._run(FinishWork(None, ops))
    return took


class DeferredCatchUp:
    """The MTP catch-up of gated steps, deferred (``SpecDecoder.deferred``): a gated step of decodes only that another
    gated step follows holds each sequence's hidden rows (``hold``; the device side keeps them at ``FinishWork``'s
    "hold" ops) until a step needs the draft's K/V whole (``flush``) or more than ``rows`` rows are held; a sequence
    that finishes while gated never pays for it, and one sure to (``finish_gated``) holds nothing. ``held``:
    ``{seq_id: [seq, first position, rows held]}``; ``blind``: ``{seq_id: seq}`` of the sequences whose rows were
    not held, which draft no more (the gate may still lift before they finish: preemption shrinks the batch)."""

    def __init__(self, engine, rows: int):
        self.engine, self.rows = engine, rows
        self.held: dict[int, list] = {}
        self.blind: dict[int, object] = {}
        self.dropped: list[int] = []  # seq_ids whose held rows the device side drops at the next FinishWork

    def forget(self, seq) -> None:
        """``seq`` was preempted (recomputed from its prompt, its draft's K/V with it): what it held is dropped at the
        next FinishWork."""
        self.blind.pop(seq.seq_id, None)
        if self.held.pop(seq.seq_id, None) is not None:
            self.dropped.append(seq.seq_id)

    def take_drops(self) -> list:
        """A FinishWork's first ops: drop the rows of the sequences forgotten since the last one."""
        ops = [("drop", self.dropped)] if self.dropped else []
        self.dropped = []
        return ops

    def hold(self, chunks, ops: list, k: int = 1, never=frozenset()) -> None:
        """Hold the hidden rows of a gated step's ``chunks`` (``k`` > 1: a gated chain's, k positions a sequence)
        but those of ``never`` (seq_ids: they finish before the gate lifts, ``finish_gated``; they turn blind);
        a sequence's rows not right after those it holds, or more than ``rows`` rows in all, flush first / after."""
        blinded, rows = [], []  # rows: (chunk index, seq_id) to hold, one "hold" op for them all
        for i, c in enumerate(chunks):
            if c.seq.is_finished and c.seq.seq_id not in self.held:
                continue
            if c.seq.seq_id in never:
                self.blind[c.seq.seq_id] = c.seq
                if self.held.pop(c.seq.seq_id, None) is not None:
                    blinded.append(c.seq.seq_id)
                continue
            held = self.held.get(c.seq.seq_id)
            if held is not None and held[1] + held[2] != c.start:  # not the position after them: keep both
                _hold(ops, rows)  # those held so far in this step go into the flush
                self.flush(ops)
                held = None
            if held is None:
                held = self.held[c.seq.seq_id] = [c.seq, c.start, 0]
            held[2] += k
            rows.append((i, c.seq.seq_id))
        _hold(ops, rows)
        finished = [i for i, d in self.held.items() if d[0].is_finished]
        if finished or blinded:
            self.held = {i: d for i, d in self.held.items() if i not in finished}
            ops.append(("drop", finished + blinded))
        self.blind = {i: s for i, s in self.blind.items() if not s.is_finished}
        if sum(d[2] for d in self.held.values()) > self.rows:
            self.flush(ops)

    def flush(self, ops: list) -> None:
        """The deferred catch-up: step 0 of the draft over every held position of the running sequences in one
        prefill-mode pass, which writes the draft's K/V there (no draft is made from them: a later step's catch-up
        does that). Finished and preempted sequences' rows are dropped (and the finished blind ones forgotten)."""
        self.blind = {i: s for i, s in self.blind.items() if not s.is_finished}
        if not self.held:
            return
        held = [d for d in self.held.values() if d[0].status is Status.RUNNING]
        self.held = {}
        if not held:
            ops.append(("flush", [], None, None))
            return
        inp = self.engine.runner.prepare(Step([Chunk(seq, p, p + n) for seq, p, n in held], is_decode=False), [], [],
                                         [])  # fmt: skip
        nxt = [seq.tokens[q + 1] for seq, p, n in held for q in range(p, p + n)]
        ops.append(("flush", [seq.seq_id for seq, _, _ in held], inp, nxt))


def _hold(ops: list, rows: list) -> None:
    """One "hold" op for ``rows`` ((chunk index, seq_id) pairs), emptied: the device side gathers their hidden rows
    in one indexed copy."""
    if rows:
        ops.append(("hold", [i for i, _ in rows], [s for _, s in rows]))
        rows.clear()


def capture_gated(spec) -> int:
    """At server start (``SpecDecoder.capture_graphs``): the gated steps' graphs of every bucket above the gate's
    smallest limit up to max_running's, the width-1 forward (``spec_graphs``) and the chains' decode graphs, keeping
    hidden rows and not (one each per chain length). Returns how many were captured."""
    r, n = spec.engine.runner, 0
    most, graphs = spec.engine.config.max_running, r.spec_exec.graphs
    if spec.gate is None or not graphs.graphable(r, most, 1):
        return 0
    for bsz in r.graph_buckets:
        if not spec.gate.least < bsz <= r._bucket(most):
            continue
        if ("verify", bsz, 1) not in r.graphs:
            r.graphs[("verify", bsz, 1)], n = graphs.capture(r, bsz, 1, None), n + 1
        for k, hidden in product(() if r.record_routing else CHAIN_LENGTHS, (True, False)):  # plain: finish_gated
            if graph_key(bsz, k, 0, False, hidden) not in r.graphs:
                r._capture(bsz, k, 0, hidden=hidden)
                n += 1
    return n
