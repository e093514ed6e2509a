"""MTP speculative decoding in the engine (``--speculative-tokens K``): the model's multi-token-prediction layers
(``areno.models.mtp``) draft up to K tokens per sequence, one target forward verifies them, and exact rejection
sampling (``speculative.verify_draft``) keeps 1..K+1 tokens distributed exactly as plain sampling.

One engine step (``SpecDecoder.step``, in place of ``Engine.step``):

1. Schedule as usual. A sequence whose last step left a draft of K_b tokens (made for its current length) decodes
   ``[last token, d_0 .. d_{K_b-1}]`` at positions n-1 .. n-1+K_b (its blocks reserved up to there); prefill chunks
   and the n samples forked from a prompt run as usual (K_b = 0: ``verify_draft`` then is plain sampling; a step
   where no row drafts samples through the runner's own ``sample_rows``, as a plain step does).
2. One target forward of the whole step (prefill-mode metadata: every row a query run), the target's logits at each
   row's K_b + 1 positions, ``verify_draft`` (the engine's logit adjustments, penalties, seeds); the log-probs
   returned are the target's.
3. Rollback of rejected positions: paged K/V past the accepted length is simply overwritten later (the blocks stay
   with the sequence); the recurrent states of hybrid models are restored from a copy taken before the forward and
   recomputed over the accepted tokens (a second forward of those rows only, when some draft token was rejected).
4. The MTP catch-up: the draft's step 0 over every position the step computed, each with its next token (the prompt's,
   or the tokens just emitted), which writes the MTP layer's own K/V (a paged cache of one layer beside the target's,
   the same block tables and slots) and gives, at each sequence's last accepted position, the first draft token.
   Then K-1 chained decode steps of the MTP layer draft the rest (the first MTP layer at every step: the families'
   checkpoints hold one; further ones are not run yet), each token drawn from the draft's distribution at the
   request's temperature/top-k/top-p (Gumbel-max on its own Philox stream).

A sample forked from a prompt drafts from its second step (its first position's MTP entry is its head's). With prefix
caching, the MTP entry at the last position of a cached prefix was computed with the next token of the sequence that
cached it: drafts may differ there, the output distribution never does.

The gate (``spec_gate.py``, ``--speculative-disable-by-batch-size``): a step where more than N sequences decode (N
fixed, or under ``auto`` a function of the accept length since the last ``take_stats``) is a plain step (its drafts
dropped, decode-mode metadata and the runner's sampling when it only decodes), and the chain drafts only when the
next step will speculate. The MTP layer's K/V must still cover every position such a step
computes (the first draft after the gate lifts attends to them): a gated step of decodes that another gated step
follows keeps its hidden rows instead (``spec_gated.DeferredCatchUp``), and their catch-up runs in one prefill-mode
pass before the next step that runs a catch-up, or once more than ``DEFER_BYTES`` of rows are held; a sequence that
finishes while gated never pays for it. (A prefix-cache hit on a decoded block whose catch-up is still held reads
stale draft K/V there: drafts may differ, the output distribution never does.) ``stats()``: ``spec_accept_len``, the
mean tokens emitted per drafting sequence and verify step (accepted drafts + 1); ``spec_gated_steps``, the steps the
gate made plain.
Tensor parallelism: this class runs on rank 0 (the leader) and plans; the device work of a step (the target forward,
the rollback, the MTP catch-up and chain) lives in ``spec_exec.SpecExec``, which every rank runs in the same order
from the records the leader broadcasts (see there). The MTP draft is sharded like a decoder block
(``build_mtp_draft``): sharding costs no collective beyond those a decoder block already runs, while replicating it
would hold the whole MTP layer (its own embedding and head too, for DeepSeek-V3) on every rank and need a whole-head
K/V cache of its own. Every token, verified or drafted, is the leader's.
CUDA graphs: a steady step (every row verifying a full draft of K tokens: no prefill chunk, fresh fork, shorter draft
or gate) runs on static shapes, each part replayed from a graph per (batch bucket, K) under graphs and run eagerly
as the same body without (so both give the same tokens), and so does a gated step of decodes only (its forward
at width 1, then the runner's sampling): the verify forward in decode mode over B x (K + 1) rows
with the delta-rule layers' inputs kept (``spec_graphs``; the rollback then one replay graph, no second forward), the
rejection sampling (``spec_sample``) and the MTP catch-up and chain (``spec_chain``). Every other step (prefill
chunks, fresh forks, shorter drafts, gated steps with prefill chunks) runs eagerly as described above.
``capture_graphs`` captures the steady steps' graphs of every bucket at server start (without TP), and the gated
forwards' of the buckets above the gate's limit. Memory beside the KV cache (the hybrids' state
stash, the deferred catch-ups' rows) is sized at build and taken out of its budget (``spec_budget``).
Routing capture (routing replay) keeps the experts of the accepted inputs only. Not built (refused at start):
multi-step decode, LoRA slots, vision-language models; per request: grammars, top log-probs.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from areno.engine import spec_chain, spec_gated, spec_graphs, spec_sample
from areno.engine.decode_graphs import graph_plan
from areno.engine.kv_cache import kv_budget, state_bytes
from areno.engine.logit_adjust import adjust_host
from areno.engine.model_runner import broadcast_step
from areno.engine.scheduler import Chunk, Step
from areno.engine.spec_exec import Chain, FinishWork, SpecExec, TargetWork, filters
from areno.engine.spec_gate import Gate, resolve_gate
from areno.engine.spec_graphs import stash_bytes, stash_rows, verify_inputs
from areno.engine.spec_sample import Draft, draft_ids, draw
from areno.engine.speculative import verify_draft
from areno.engine.step_inputs import StepInputs
from areno.models.mtp import build_mtp_draft

log = logging.getLogger("areno.engine")

DEFER_BYTES = 256 << 20  # hidden rows held for the deferred MTP catch-up of gated steps before it runs anyway
# (fewer where max_running x max_model_len rows are fewer); taken out of the KV-cache budget (``spec_budget``)


@dataclass
class Row:
    seq: object
    index: list[int]  # hidden rows of its K_b + 1 positions in the step's forward
    draft: Draft | None
    fresh_fork: bool = False  # a sample forked from its head in this step: no draft yet


def check_speculative(engine) -> None:
    """Refuse what speculative decoding does not cover yet (a ValueError naming the setting)."""
    cfg, model = engine.config, engine.model
    if not getattr(model, "num_mtp_layers", 0) or getattr(model, "mtp_draft_parts", None) is None:
        raise ValueError(f"--speculative-tokens needs a model with MTP layers ({model.config.model_type}: none loaded)")
    refused = [(cfg.decode_steps > 1, "--decode-steps > 1"), (cfg.max_loras > 0, "--max-loras"),
               (model.is_multimodal, "a vision-language model"),
               (getattr(cfg, "kv_cache_dtype", "auto") == "fp8", "--kv-cache-dtype fp8")]
    for bad, name in refused:
        if bad:
            raise ValueError(f"--speculative-tokens with {name} is not built yet")


class SpecBudget(NamedTuple):
    gate: Gate | None  # the gate (None: every step speculates)
    rows: int  # the most sequences a steady step verifies (its graph bucket where replayed): the stash's rows
    defer_rows: int  # hidden rows of deferred catch-ups held before they run anyway (DEFER_BYTES, or all there are)
    reserved: int  # device bytes beside the KV cache from its budget: the stash, the held rows where gated


def spec_budget(engine, device, dtype, state_dtype=torch.float32) -> SpecBudget | None:
    """Speculation's sizes, known before the KV cache is planned (None without ``--speculative-tokens``): the gate
    resolved, the hybrids' state stash (``spec_graphs.stash_rows``/``stash_bytes``) and, where the gate can make a
    step plain, the deferred catch-ups' hidden rows (``defer_rows`` and one gated chain's beyond them:
    ``DeferredCatchUp.hold``).
    ``state_dtype``: the delta-rule state pool's (--mamba-ssm-cache-dtype): each decode row's traffic (the gate)."""
    cfg, k = engine.config, engine.config.speculative_tokens
    if not k:
        return None
    check_speculative(engine)
    slot = state_bytes(engine.model, 1, dtype, state_dtype)  # a hybrid's state slot, each decode row's traffic
    gate = stash_cap(engine, resolve_gate(cfg.speculative_disable_by_batch_size, engine.model, k, device, slot),
                     device, dtype, state_dtype)
    most = None if gate is None else gate.most
    rows = stash_rows(most, cfg.max_running, *graph_plan(cfg.max_running, cfg.eager_decode, device), k + 1)
    row_bytes = engine.model.config.hidden_size * dtype.itemsize
    defer = max(1, min(DEFER_BYTES // row_bytes, cfg.max_running * engine.max_model_len))
    chain = spec_gated.GATED_CHAIN * cfg.max_running  # one gated chain's rows past defer_rows before the flush
    held = defer + chain if gate is not None and gate.least < cfg.max_running else 0
    return SpecBudget(gate, rows, defer, stash_bytes(engine.model, rows, k, dtype) + held * row_bytes)


def stash_cap(engine, gate: Gate | None, device, dtype, state_dtype) -> Gate | None:
    """``auto``'s gate capped where a hybrid's rollback stash (``spec_graphs.stash_bytes`` a speculating row) at the
    gate's largest N would take more than half of the KV-cache budget left after the recurrent-state slots: the
    stash holds that half's rows, and the gate speculates at no larger batch (logged)."""
    cfg, model = engine.config, engine.model
    row = stash_bytes(model, 1, gate.k, dtype) if gate is not None and gate.fixed is None else 0
    if not row:
        return gate
    left = kv_budget(device, cfg.kv_cache_memory) - state_bytes(model, cfg.max_running, dtype, state_dtype)
    fits = max(1, left // 2 // row)
    if fits >= gate.most:
        return gate
    log.info("speculative decoding: auto gate capped at %d sequences (the rollback stash's %.1f GB, half the KV-cache "
             "budget left after the state slots)", fits, fits * row / 1e9)
    return replace(gate, cap=fits)


def spec_decoder(engine) -> SpecDecoder | None:
    """The engine's ``SpecDecoder`` for its (new) runner with ``--speculative-tokens`` (the draft built once, the
    gate and sizes those of ``engine.spec_budget``), else None."""
    k = engine.config.speculative_tokens
    if not k:
        return None
    old = getattr(engine, "spec", None)
    return SpecDecoder(engine, k, old)


def check_request(spec, options) -> None:
    """Refuse a request speculative decoding does not serve yet (``spec``: the engine's SpecDecoder or None)."""
    if spec is not None and (options.top_logprobs or options.grammar is not None):
        raise ValueError("--speculative-tokens does not serve requests with top_logprobs or a grammar yet")


class SpecDecoder:
    """The engine's speculative steps (see the module docstring); built with the engine's runner, on every TP rank
    (a follower only runs the ``SpecExec`` it attaches to the runner)."""

    def __init__(self, engine, k: int, old: SpecDecoder | None = None):
        """``old``: the decoder of the engine's previous runner, whose draft this one keeps."""
        self.engine, self.k = engine, k
        self.draft = old.draft if old is not None else build_mtp_draft(engine.model)
        runner = engine.runner
        budget = engine.spec_budget
        runner.spec_exec = SpecExec(runner, self.draft, budget.rows, k + 1)  # the device side (released with it)
        self.drafts: dict[int, Draft] = {}
        self.deferred = spec_gated.DeferredCatchUp(engine, budget.defer_rows)  # gated steps' MTP catch-up
        self.gate = budget.gate  # the largest batch that speculates, by the accept length (None: every step does)
        names = ("verify_rows", "emitted", "accepted", "proposed", "drafted", "spec_gated_steps")
        self.counts = dict.fromkeys(names, 0)  # the window's (since the last take_stats)
        self.totals = old.lifetime() if old is not None else dict(self.counts)  # since the engine started

    @property
    def mtp_cache(self) -> torch.Tensor:
        return self.engine.runner.spec_exec.mtp_cache

    @property
    def limit(self) -> int | None:
        """The largest batch that speculates now (None: every step does): the gate's N at the accept length since
        the last ``take_stats`` (a rollout's; ``auto``), constant while steps are gated (they verify nothing)."""
        c = self.counts
        return None if self.gate is None else self.gate.limit(c["emitted"], c["verify_rows"])

    def stats(self) -> dict:
        """Since the last ``take_stats`` (the window): ``spec_accept_len`` (tokens emitted per drafting sequence and
        verify step), ``verify_rows``, ``emitted``, ``accepted`` (draft tokens accepted), ``proposed`` (draft tokens
        verified), ``drafted`` (drafts made), ``spec_gated_steps`` (steps run plain: too many sequences decoding)."""
        n = self.counts["verify_rows"]
        return {"spec_accept_len": self.counts["emitted"] / n if n else 0.0, **self.counts}

    def take_stats(self) -> dict:
        """``spec_accept_len`` and ``spec_gated_steps`` since the last call (a rollout's), and with a gate
        ``spec_limit``, its N at the end (under ``auto``: at the window's accept length); every count restarted, so
        ``auto``'s next window starts from its prior."""
        out = {"spec_accept_len": self.stats()["spec_accept_len"], "spec_gated_steps": self.counts["spec_gated_steps"]}
        if self.gate is not None:
            out["spec_limit"] = self.limit
        self.counts = dict.fromkeys(self.counts, 0)
        return out

    def count(self, **counts: int) -> None:
        """Add to the window's counts and the engine's totals alike."""
        for name, n in counts.items():
            self.counts[name] += n
            self.totals[name] += n

    def lifetime(self) -> dict:
        """The counts since the engine started (``areno serve``'s ``/metrics``; another thread may read them: each
        only grows)."""
        return dict(self.totals)

    def reopen(self) -> None:
        """Restart ``auto``'s window from its prior while the engine is idle (a server's, ``areno serve``: its
        windows run idle to idle). A window whose accept length fell below break-even verifies nothing more, so
        without this a server would never see its drafts improve with a new mix of requests. Stats since the last
        ``take_stats`` restart too; nothing else changes."""
        if self.gate is not None and self.gate.fixed is None and self.counts["verify_rows"]:
            self.take_stats()

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture the steady steps' graphs of every bucket they replay now (``Engine.capture_graphs``, at server
        start): the verify, a hybrid's replay of the accepted tokens, the sampling and the chain for rows without
        logit adjustments or filters (those with them capture theirs on first use); returns how many. None under TP
        (the ranks capture together on first use) or without graphs."""
        r, width = self.engine.runner, self.k + 1
        if r.tp_group is not None or not r.use_graphs:
            return 0
        ex, n = r.spec_exec, 0
        for bsz in ex.graphs.capture_buckets(r, width):
            key = ("verify", bsz, width)
            if key not in r.graphs:
                r.graphs[key], n = ex.graphs.capture(r, bsz, width, ex.graphs.stash), n + 1
            if ex.graphs.stash is not None and ("replay", bsz) not in r.graphs:  # a hybrid's commit (its inputs kept)
                r.graphs[("replay", bsz)], n = spec_graphs.capture_replay(r, ex.graphs.stash, bsz), n + 1
            n += spec_sample.capture_plain(r, bsz, self.k, r.graphs[key][2][1])
            n += spec_chain.capture_plain(r, ex, bsz, width, Chain([], [], [], [], [], [], [], [], []))
        return n + spec_gated.capture_gated(self)

    def _run(self, work):
        """Device work on every rank: broadcast to the TP followers first, then run here."""
        r = self.engine.runner
        if r.tp_group is not None:
            broadcast_step(work, r.tp_group)
        return work(r) if isinstance(work, FinishWork) else r.spec_exec.target(r, work)

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self) -> list:
        e = self.engine
        if e.chains.ahead is not None:  # a gated chain queued ahead (spec_gated's lookahead)
            return spec_gated.step_ahead(self)
        if e.grammars.waiting and (failed := e.grammars.admit()):
            return failed
        step = e.scheduler.schedule(admit=True)
        if not step.chunks:
            return []
        for seq in step.preempted:  # recomputed from their prompt: what they held is gone with their blocks
            self.deferred.forget(seq)
            self.drafts.pop(seq.seq_id, None)  # (a draft holds its whole chain's distributions: not kept stale)
        if len(self.drafts) > len(e.scheduler.running):  # those of finished, aborted or preempted sequences
            running = {s.seq_id for s in e.scheduler.running}
            self.drafts = {i: d for i, d in self.drafts.items() if i in running}
        copies, state_copies = list(e.blocks.pending_copies), list(e.blocks.pending_state_copies)
        e.blocks.pending_copies.clear()
        e.blocks.pending_state_copies.clear()
        gated = self._gated(step)
        gated_decode = gated and step.is_decode
        if gated_decode and (k := spec_gated.chain_length(self, step)):
            return spec_gated.gated_chain(self, step, copies, state_copies, k)
        chunks, rows, next_known = self._plan(step, gated)
        width = self.k + 1 if self._steady(chunks, rows) else 1
        inp = self._prepare(chunks, rows, copies, gated_decode, width)
        inp.state_copies = state_copies or None
        inp.adjust = e.runner.adjuster.plan([r.seq for r in rows])
        e.step_counts["single"] += 1
        # a steady step's verify takes the logits of every row itself and leaves the states to its replay (roll_back)
        logit_rows, save = [], []
        if width == 1:
            if any(row.draft is not None for row in rows):  # every row's logit rows, padded to the widest row's
                widest = max(len(row.index) for row in rows)
                logit_rows = [i for row in rows for i in self._padded(row, widest)]
            else:
                logit_rows = list(inp.row_index)
            if e.runner.states is not None:
                save = [row.seq.state_slot for row in rows if row.draft is not None]
        with torch.inference_mode():
            hidden = self._run(TargetWork(inp, save, logit_rows, width, gated_decode))
            verified = self._verify(inp, rows, hidden, logit_rows)
        redo = self._redo(rows, verified, width > 1)
        meta = e.runner.spec_exec.last[1]
        self._keep_routing(chunks, rows, meta, verified)
        e.scheduler.after_step(step)
        emitted = self._append(rows, verified)
        ops = self.deferred.take_drops()
        chain = None
        if gated_decode and not self._speculates_next():
            self.deferred.hold(chunks, ops, never=spec_gated.finish_gated(self))
        else:
            self.deferred.flush(ops)
            chain = self._catch_up(rows, emitted, next_known, ops, width > 1)
        with torch.inference_mode():
            drafts = self._run(FinishWork(redo, ops))
        for row, (toks, size, probs, i, ids) in zip(chain or (), drafts or ()):
            self.drafts[row.seq.seq_id] = Draft(len(row.seq), toks, size, probs, i, ids)
        self.count(drafted=len(drafts or ()))
        return [r.seq for r in rows]

    def _steady(self, chunks, rows) -> bool:
        """A steady step (its verify replayed from a graph under CUDA graphs, ``spec_graphs``): every chunk a decode
        row verifying a full draft of K tokens (no prefill chunk, no fresh fork, no shorter draft)."""
        return bool(rows) and len(rows) == len(chunks) and all(
            row.draft is not None and row.draft.size == self.k for row in rows)

    def _prepare(self, chunks, rows, copies, decode: bool, width: int) -> StepInputs:
        """The step's inputs: prefill-mode (each chunk a query run), decode-mode for a gated step of decodes, or a
        steady step's ``width`` decode rows per sequence (its positions n - 1 .. n - 1 + K; sampling settings and
        recurrent-state slots per sequence)."""
        r, seqs = self.engine.runner, [row.seq for row in rows]
        if width > 1:
            inp = verify_inputs(r, seqs, width, [row.index[0] for row in rows], copies)
            if r.tp_group is None:  # the drafts' tokens stay on the device: the verify takes them there
                inp.ids = [t for s in seqs for t in [s.tokens[-1]] + [0] * self.k]
                inp.draft_ids = draft_ids([row.draft for row in rows], r.device)
                return inp
        else:
            inp = r.prepare(Step(chunks, is_decode=decode), seqs, [row.index[0] for row in rows], copies)
        inp.ids = [t for c in chunks for t in self._chunk_ids(c)]
        return inp

    def _gated(self, step: Step) -> bool:
        """Whether the gate makes ``step`` plain (counted): more sequences decode in it than the limit, or under
        ``auto`` its prompt tokens make the verify rows cost more than they give (``Gate.speculates``)."""
        if self.gate is None:
            return False
        decode = [c.samples and c.start == len(c.seq) - 1 for c in step.chunks]
        prefill = sum(c.end - c.start for c, d in zip(step.chunks, decode) if not d)
        gated = not self._speculates(sum(decode), prefill)
        self.count(spec_gated_steps=int(gated))
        return gated

    def _speculates_next(self) -> bool:
        """Whether the next step will speculate (its drafts are made now): the sequences that will decode in it
        (the running ones with their prompt computed; preemption can only lower that) are within the limit and,
        under ``auto``, the prompt tokens it will likely prefill (those left, up to the token budget) leave it
        speculating (``Gate.speculates``). A wrong guess costs drafts or their absence for a step, never tokens."""
        if self.gate is None:
            return True
        sched = self.engine.scheduler
        decoding = sum(1 for s in sched.running if s.num_computed >= len(s) - 1)
        budget, prompts = max(sched.max_batched_tokens - decoding, 0), 0
        if self.gate.fixed is None:  # (a fixed N ignores them) summed until the budget is full: a long queue costs
            left = (len(s) - 1 - s.num_computed for s in sched.running if s.num_computed < len(s) - 1)
            for n in itertools.chain(left, (len(s) for s in sched.waiting)):  # no more than its first few prompts
                prompts += n
                if prompts >= budget:
                    break
        return self._speculates(decoding, min(prompts, budget))

    def _speculates(self, decoding: int, prompts: int) -> bool:
        """``Gate.speculates`` for a step of ``decoding`` sequences decoding and ``prompts`` prompt tokens, with
        every sequence in the engine (running and waiting) as the batch that follows, at the window's counts."""
        sched, c = self.engine.scheduler, self.counts
        future = len(sched.running) + len(sched.waiting)
        return self.gate.speculates(decoding, prompts, future, c["emitted"], c["verify_rows"])

    def _plan(self, step: Step, gated: bool = False):
        """The step's chunks extended by each drafting sequence's K_b tokens (none when ``gated``), its sampled rows,
        and for every computed position the next token when it is known before sampling (else None)."""
        e, rows, chunks, next_known, off = self.engine, [], [], [], 0
        for c in step.chunks:
            seq, kb, length = c.seq, 0, len(c.seq)
            d = self.drafts.pop(seq.seq_id, None) if c.samples else None
            if d is not None and not gated and d.length == length and c.start == length - 1:
                kb = d.size
                if not e.blocks.reserve_tokens(seq, length + kb):
                    kb, d = 0, None
            else:
                d = None
            chunk = Chunk(seq, c.start, c.end + kb)
            chunk.draft = d
            chunks.append(chunk)
            n = c.end - c.start
            if c.start < length - 1:  # prompt positions: the next token is known (a decode's last one is not)
                next_known += [seq.tokens[t + 1] if t + 1 < length else None for t in range(c.start, c.end)]
            else:
                next_known.append(None)
            next_known += [None] * kb
            if c.samples:
                last = off + n - 1
                rows.append(Row(seq, list(range(last, last + kb + 1)), d))
                rows += [Row(ch, [last], None, True) for ch in getattr(seq, "children", []) if not ch.is_finished]
            off += n + kb
        return chunks, rows, next_known

    @staticmethod
    def _chunk_ids(c: Chunk) -> list[int]:
        d = getattr(c, "draft", None)
        head = c.seq.tokens[c.start : c.end - (d.size if d else 0)]
        return head + (list(d.tokens) if d else [])

    @staticmethod
    def _padded(row: Row, width: int) -> list[int]:
        """A row's K_b + 1 hidden rows padded to the step's ``width`` K + 1 (its last one repeated): the verify's
        logits."""
        return row.index + [row.index[-1]] * (width - len(row.index))

    def _keep_routing(self, chunks, rows, meta, verified) -> None:
        """Routing capture: each chunk's sequence keeps the experts of the tokens it computed (a drafting sequence:
        its accepted inputs only); samples not yet forked take their head's (as ``Engine`` does)."""
        if meta.routing_out is None:
            return
        routes = meta.routing_out.permute(1, 0, 2).to(torch.int16).cpu().numpy()  # [T, layers, k]
        meta.routing_out = None  # the draft's MoE block must not write there
        emitted = {row.seq.seq_id: len(t) for row, t in zip(rows, verified[0]) if row.draft is not None}
        off = 0
        for c in chunks:
            n = c.end - c.start
            take = emitted[c.seq.seq_id] if getattr(c, "draft", None) is not None else n  # 1 + accepted drafts
            c.seq.routing.append((c.start, routes[off : off + take]))
            off += n
            if c.samples:
                for child in getattr(c.seq, "children", []):
                    child.routing = list(c.seq.routing)

    def _verify(self, inp: StepInputs, rows: list[Row], hidden, logit_rows: list[int]):
        """The rows' tokens and log-probs (verify_draft, or the plain step's sampling when no row drafts), each
        row's draft length, and its accepted draft tokens."""
        r, dev = self.engine.runner, self.engine.runner.device
        B = len(rows)
        if not B:  # prefill chunks that do not reach the end of their prompts: K/V (and the MTP's) only
            return [], [], [], []
        nd = [len(row.index) - 1 for row in rows]
        K = max(nd)
        if not K:  # no draft to verify (a gated step, prefills): the plain step's sampling
            toks, lps, _ = r.sample_rows(inp, hidden)
            return [[t] for t in toks.tolist()], [[lp] for lp in lps.tolist()], nd, nd
        ex = r.spec_exec
        if ex.logits is not None:  # a steady step: its rejection sampling eager or replayed (spec_sample)
            toks, lps, accepted = draw(r, inp, [row.draft for row in rows], self.k,
                                       ex.logits, ex.graphs.bucket)
            return toks, lps, nd, accepted
        V = r.vocab_size
        logits = r.logits(hidden[torch.tensor(logit_rows, device=dev)]).view(B, K + 1, V)
        tokens = torch.zeros(B, K, dtype=torch.int64, device=dev)
        probs = torch.zeros(B, K, V, dtype=torch.float32, device=dev)
        for b, row in enumerate(rows):
            if row.draft is not None:
                tokens[b, : nd[b]] = torch.tensor(row.draft.tokens, device=dev)
                probs[b, : nd[b]] = row.draft.probs
        adj = None
        if inp.adjust is not None:
            adj = {k: v.to(dev) for k, v in adjust_host(inp.adjust, B, inp.adjust.width).items()}
        top_k, top_p = filters(inp.top_k, inp.top_p)
        out = verify_draft(logits, tokens, probs, torch.tensor(nd, device=dev), temperature=inp.temperature,
                           seeds=inp.seeds, offsets=inp.offsets, top_k=top_k, top_p=top_p, adjust=adj,
                           token_state=r.adjuster.token_state if adj is not None and "pen_slot" in adj else None)
        toks, lps = out.lists()
        return toks, lps, nd, out.accepted.tolist()

    def _redo(self, rows: list[Row], verified, steady: bool = False) -> tuple | None:
        """Hybrid models: (which saved states to restore, the inputs of their accepted tokens) for the drafting rows
        that rejected a draft token, whose target forward runs again over the accepted inputs (K/V rewritten with
        the same values); None when none did (planned before the rows' tokens are appended). A steady step's:
        ("steps", every row's state slot, its accepted drafts), the replay that commits them (its verify wrote no
        delta-rule state)."""
        r = self.engine.runner
        if r.states is None:
            return None
        _, _, nd, accepted = verified
        if steady:  # every row's accepted inputs replayed on its state, which the verify left (VerifyGraphs.roll_back)
            return "steps", [row.seq.state_slot for row in rows], list(accepted[: len(rows)])
        drafting = [b for b, row in enumerate(rows) if row.draft is not None]
        redo = [(n, b) for n, b in enumerate(drafting) if accepted[b] < nd[b]]
        if not redo:
            return None
        chunks = []
        for _, b in redo:
            seq, a = rows[b].seq, accepted[b]
            c = Chunk(seq, len(seq) - 1, len(seq) + a)
            c.draft = Draft(len(seq), rows[b].draft.tokens[:a], a, rows[b].draft.probs[:a])
            chunks.append(c)
        inp = r.prepare(Step(chunks, is_decode=False), [], [], [])
        inp.ids = [t for c in chunks for t in self._chunk_ids(c)]
        return [n for n, _ in redo], inp

    def _append(self, rows: list[Row], verified) -> list[list[int]]:
        """Each row's emitted tokens appended up to its stop; returns them (all of them, for the MTP catch-up)."""
        e = self.engine
        toks, lps, nd, _ = verified
        verifying = [(len(t), k) for t, k in zip(toks, nd) if k]
        if verifying:  # counted once for the step (a call a row cost ~2 us)
            emitted = sum(n for n, _ in verifying)
            self.count(verify_rows=len(verifying), emitted=emitted, accepted=emitted - len(verifying),
                       proposed=sum(k for _, k in verifying))
        for row, t, lp, k in zip(rows, toks, lps, nd):
            reason = e.stopper.extend(row.seq, t, lp)
            if k or len(t) > 1:
                e.scheduler.after_decode(row.seq)
            if reason is not None:
                row.seq.finish(reason)
                e.scheduler.finish(row.seq)
        return toks

    # ---- drafting ------------------------------------------------------------------------------------------
    def _catch_up(self, rows, emitted, next_known, ops: list, steady: bool = False) -> list | None:
        """The catch-up op (MTP step 0 over every computed position, its K/V written) and the chain for live rows;
        returns the rows the chain drafts for (None: no chain)."""
        e = self.engine
        nxt = list(next_known)
        for row, toks in zip(rows, emitted):
            if row.fresh_fork:
                continue
            for i, t in enumerate(toks):  # the last input position's next token is the first emitted one
                nxt[row.index[i]] = t
        live = []  # (row, K_b, hidden row of its last accepted position)
        for row, toks in zip(rows, emitted) if self._speculates_next() else ():
            seq = row.seq
            kb = min(self.k, e.max_model_len - len(seq), seq.options.max_new_tokens - seq.num_output - 1)
            if row.fresh_fork or seq.is_finished or kb < 1 or seq.seq_id in self.deferred.blind or \
                    not e.blocks.reserve_tokens(seq, len(seq) + kb):
                continue
            live.append((row, kb, row.index[len(toks) - 1]))
        chain = self._chain(live, steady) if live else None
        ops.append(("catch_up", [0 if t is None else t for t in nxt], chain))
        return [row for row, _, _ in live] if live else None

    def _chain(self, live, steady: bool = False) -> Chain:
        """The draft steps for each live (row, K_b, hidden row): step 0's output there, then MTP decode step j at
        each sequence's position len - 2 + j for the rows with K_b > j (their inputs prepared here)."""
        r = self.engine.runner
        seqs, kbs = [row.seq for row, _, _ in live], [kb for _, kb, _ in live]
        decode = []
        for j in range(1, 1 if steady else max(kbs)):  # a steady step's chain computes its positions itself
            active = [s for s, kb in zip(seqs, kbs) if kb > j]
            inp = r.prepare(Step([Chunk(s, len(s) - 2 + j, len(s) - 1 + j) for s in active], is_decode=True), [],
                            [], [])  # fmt: skip
            inp.ids = [0] * len(active)  # the previous step's draft tokens, on the device
            decode.append(inp)
        opts = [s.options for s in seqs]
        return Chain([i for _, _, i in live], kbs, [o.temperature for o in opts], [o.top_k for o in opts],
                     [o.top_p for o in opts], [s.seed for s in seqs], [len(s) for s in seqs], decode,
                     [list(s.block_table) for s in seqs] if steady else None)
