"""The device work of a speculative step (``spec_decode``), the same on every rank of a tensor-parallel group.

``SpecDecoder`` (on TP rank 0, the leader, or alone) plans a step on the host and hands its device work to
``SpecExec`` (one per runner: the MTP draft's paged K/V, the recurrent states saved before a verify, the hidden rows
of deferred catch-ups) as two records, each first sent through the engine's step broadcast
(``model_runner.broadcast_step``; a follower's ``TPWorker`` calls the record with its runner):

- ``TargetWork``: block copies (the MTP cache's too), the states of drafting hybrid rows saved, the target forward,
  and the logits of the rows the leader verifies or samples (gathered over the vocab shards, a collective). A steady
  step's (``width`` > 1) is the verify of ``spec_graphs``, the logits inside it, replayed from a CUDA graph on every
  rank when the runner uses graphs (and its catch-up and chain those of ``spec_chain``); a gated step of decodes
  runs the same body at width 1 (its forward replayed per bucket too; the runner's sampling after it).
- ``FinishWork``, after the leader verified, appended and decided: the rollback of rejecting hybrid rows (states
  restored, a forward over their accepted inputs; a steady step's: every row's accepted tokens replayed on its
  delta-rule states, ``VerifyGraphs.roll_back``) and the MTP ops in the leader's order: ``hold`` the hidden rows of
  a gated step's sequences (their catch-up deferred; one indexed gather), ``drop`` held rows, ``flush`` the held
  rows' catch-up, ``catch_up`` over the step's positions and then the ``Chain`` of draft steps. The chain's tokens
  are drawn on the leader (its Philox streams, the requests' settings) and broadcast to the followers before the next
  draft step needs them.

The followers never sample: every token is the leader's; they run the same forwards in the same order on their shard
of the weights, so their K/V, MTP K/V and recurrent states stay those of the leader's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from areno.engine.spec_chain import DRAFT_STREAM, run_chain
from areno.engine.spec_graphs import VerifyGraphs
from areno.engine.step_inputs import StepInputs, unused_filters
from areno.kernels.draft_draw import draw_from_probs
from areno.kernels.sampler import sampling_probs


def filters(top_k: list[int], top_p: list[float]) -> tuple:
    """Per-row top-k / top-p, each None when no row filters (the samplers then skip sorting the vocabulary)."""
    no_k, no_p = unused_filters(top_k, top_p)
    return (None if no_k else top_k), (None if no_p else top_p)


@dataclass
class TargetWork:
    """A step's target forward: ``inp`` (its ids with the drafts), the recurrent-state slots to save first, and the
    hidden rows whose logits the leader gathers (to verify or sample)."""

    inp: StepInputs
    save: list[int]
    logit_rows: list[int]
    width: int = 1  # > 1: a steady step's verify (``spec_graphs``), B x width decode rows, logits of every row
    gated_decode: bool = False  # a gated step of decodes only: the verify body at width 1 (graph-replayed), no logits

    @torch.inference_mode()
    def __call__(self, runner) -> None:  # a follower: the forward, then its part of the leader's logits gather
        hidden = runner.spec_exec.target(runner, self)
        if self.logit_rows and self.width == 1:
            runner.logits(hidden[torch.tensor(self.logit_rows, device=runner.device)])


@dataclass
class Chain:
    """The draft steps after a catch-up: each drafting sequence's hidden row (its last accepted position), K_b,
    sampling settings and length; ``decode[j - 1]``: MTP decode step j's inputs (the rows with K_b > j)."""

    pick: list[int]
    kbs: list[int]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int]
    lengths: list[int]
    decode: list[StepInputs]
    tables: list[list[int]] | None = None  # the rows' block tables (a steady step's chain, ``spec_chain``)


@dataclass
class FinishWork:
    """After the verify: ``redo`` (indices into the saved states, the inputs of the accepted tokens; a steady step's:
    ("steps", state slots, accepted drafts) of every row, ``VerifyGraphs.roll_back``) or None, then the MTP ``ops``
    in order (see the module docstring)."""

    redo: tuple | None
    ops: list

    @torch.inference_mode()
    def __call__(self, runner) -> list | None:
        return runner.spec_exec.finish(runner, self)


class SpecExec:
    """One runner's device state and work for speculative decoding (see the module docstring)."""

    def __init__(self, runner, draft, rows: int, width: int):
        """``rows``: the most sequences a steady step verifies, ``width`` its K + 1 (the stash's size,
        ``spec_graphs``)."""
        self.draft = draft
        self.mtp_cache = torch.zeros_like(runner.kv_cache[0])  # the MTP layer's paged K/V: one more cache layer
        self.group = runner.tp_group
        self.leader = self.group is None or dist.get_rank(self.group) == 0
        self.held: dict[int, list] = {}  # seq_id -> hidden rows whose catch-up is deferred
        self.saved = None  # (slots, conv, recurrent) of the drafting hybrid rows before the target forward
        self.last = None  # (hidden, meta, positions) of the step's target forward
        self.logits = None  # a steady step's verify logits (every row), else None
        self.graphs = VerifyGraphs(runner, rows, width)

    @property
    def mtp_kv(self) -> tuple:
        return tuple(self.mtp_cache[e] for e in range(self.mtp_cache.shape[0]))

    def target(self, r, work: TargetWork):
        inp = work.inp
        r.prologue(inp)
        self.copy_draft_blocks(r, inp.copies)
        self.saved = None
        if r.states is not None and work.save:
            slots = torch.tensor(work.save, device=r.device)
            self.saved = (slots, r.states.conv[:, slots].clone(), r.states.recurrent[:, slots].clone())
        if work.width > 1 or work.gated_decode:
            hidden, self.logits, meta, pos = self.graphs.run(r, inp, work.width, r.record_routing and self.leader)
            self.last = (hidden, meta, pos)
            return hidden
        self.logits = None
        ids, pos, meta = r.step_tensors(inp)
        if r.record_routing and self.leader:
            meta.routing_out = torch.empty(r.model.num_moe_layers, len(inp.ids), r.model.moe_top_k,
                                           dtype=torch.int32, device=r.device)  # fmt: skip
        hidden = r.model(ids, pos, kv_caches=r.kv_caches, attn_metadata=meta)
        self.last = (hidden, meta, pos)
        return hidden

    def copy_draft_blocks(self, r, copies) -> None:
        """The step's copy-on-write block copies in the MTP layer's cache too (the target's: ``r.prologue``)."""
        if copies:
            src = torch.tensor([p[0] for p in copies], device=r.device)
            dst = torch.tensor([p[1] for p in copies], device=r.device)
            self.mtp_cache[:, dst] = self.mtp_cache[:, src]

    def finish(self, r, work: FinishWork) -> list | None:
        """The rollback and the MTP ops; returns the chain's drafts on the leader ([(tokens, K_b, probs, row, ids)]
        per drafting sequence, ``spec_sample.Draft``'s fields), else None."""
        if work.redo is not None and work.redo[0] == "steps":  # a steady step's: its accepted tokens replayed
            self.graphs.roll_back(r, *work.redo[1:])
        elif work.redo is not None:
            self._rollback(r, *work.redo)
        drafts = None
        for op in work.ops:
            if op[0] == "hold":  # gathered: a replayed forward's hidden rows are the graph's, the next replay's too
                source = self.last[0]  # [rows, H] of a gated step; [k, rows, H] of a gated chain (k rows each)
                idx = torch.tensor(op[1], device=source.device)
                rows = source.index_select(0, idx) if source.dim() == 2 else \
                    source.index_select(1, idx).transpose(0, 1).contiguous()  # [n, k, H]: a sequence's k contiguous
                for j, seq_id in enumerate(op[2]):  # views, no copy each
                    self.held.setdefault(seq_id, []).append(rows[j].reshape(-1, rows.shape[-1]))
            elif op[0] == "drop":
                for i in op[1]:
                    self.held.pop(i, None)
            elif op[0] == "flush":
                self._flush(r, *op[1:])
            else:
                drafts = self._catch_up(r, *op[1:])
        self.last = self.saved = self.logits = None
        return drafts

    def _rollback(self, r, which: list[int], inp: StepInputs) -> None:
        """Restore the saved states ``which`` and run the target over the accepted inputs (K/V rewritten alike)."""
        slots, conv, rec = self.saved
        idx = torch.tensor(which, device=r.device)
        r.states.conv[:, slots[idx]] = conv[:, idx]
        r.states.recurrent[:, slots[idx]] = rec[:, idx]
        ids, pos, meta = r.step_tensors(inp)
        r.model(ids, pos, kv_caches=r.kv_caches, attn_metadata=meta)

    def _flush(self, r, seq_ids: list[int], inp: StepInputs | None, nxt: list[int] | None) -> None:
        """The deferred catch-up of the held rows of ``seq_ids`` (in order, each contiguous from its first held
        position) in one prefill-mode pass; every held row is dropped."""
        rows = [h for i in seq_ids for h in self.held[i]]
        self.held = {}
        if not rows:
            return
        _, pos, meta = r.step_tensors(inp)
        ids = torch.tensor(nxt, dtype=torch.int64, device=r.device)
        self.draft(r.model, 0, torch.cat(rows), ids, pos, meta, self.mtp_kv)

    def _catch_up(self, r, nxt: list[int], chain: Chain | None):
        """Draft step 0 over every position of the target forward (each with its next token), then the chain (a
        steady step's: ``spec_chain``, on static shapes)."""
        if self.logits is not None and chain is not None:
            return run_chain(r, self, chain, nxt)
        hidden, meta, pos = self.last
        meta.routing_out = None  # the draft's MoE block must not write the target's routes
        nxt = nxt + [0] * (hidden.shape[0] - len(nxt))  # a replayed verify's padding rows (slot -1: no write)
        ids = torch.tensor(nxt, dtype=torch.int64, device=r.device)
        out, g = self.draft(r.model, 0, hidden, ids, pos, meta, self.mtp_kv)
        return None if chain is None else self._chain(r, chain, out, g)

    def _chain(self, r, c: Chain, out, g) -> list | None:
        """Draft tokens for each row of ``c``: step 0's output at its pick, then decode steps of the MTP layer for
        the rows still drafting, each step's tokens drawn on the leader and broadcast before the next step."""
        pick = torch.tensor(c.pick, device=r.device)
        o, g = out[pick], g[pick]
        active, steps, t = list(range(len(c.pick))), max(c.kbs), None
        drawn = []  # (active rows, tokens, probs) per step, on the leader
        for j in range(steps):
            if j:
                keep = [a for a, i in enumerate(active) if c.kbs[i] > j]
                active = [active[a] for a in keep]
                keep = torch.tensor(keep, device=r.device)
                _, pos, meta = r.step_tensors(c.decode[j - 1])
                o, g = self.draft(r.model, 0, g[keep], t[keep], pos, meta, self.mtp_kv)
            logits = r.logits(o, self.draft.head_weight(r.model, j))
            if self.leader:
                t, q = self._draw(c, active, j, logits)
                drawn.append((active, t, q))
            else:
                t = torch.empty(len(active), dtype=torch.int64, device=r.device)
            if self.group is not None and j + 1 < steps:
                dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        if not self.leader:
            return None
        toks, probs = [[] for _ in c.pick], [[] for _ in c.pick]
        for rows, t, q in drawn:
            for a, (i, tok) in enumerate(zip(rows, t.tolist())):
                toks[i].append(tok)
                probs[i].append(q[a])
        return [(tk, len(tk), torch.stack(pr), None, None) for tk, pr in zip(toks, probs)]

    @staticmethod
    def _draw(c: Chain, rows: list[int], j: int, logits):
        """Draft tokens from the draft's logits at each row's request settings (Gumbel-max on the draft's own Philox
        stream): (tokens [R] int64, probs [R, V])."""
        dev = logits.device
        top_k, top_p = filters([c.top_k[i] for i in rows], [c.top_p[i] for i in rows])
        q = sampling_probs(logits, temperature=torch.tensor([c.temperature[i] for i in rows], device=dev),
                           top_k=None if top_k is None else torch.tensor(top_k, device=dev),
                           top_p=None if top_p is None else torch.tensor(top_p, device=dev))
        seeds = torch.tensor([c.seeds[i] for i in rows], dtype=torch.int64, device=dev)
        offsets = torch.tensor([c.lengths[i] + j + DRAFT_STREAM for i in rows], dtype=torch.int64, device=dev)
        return draw_from_probs(q, seeds, offsets), q
