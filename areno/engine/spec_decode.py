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

The gate (``spec_gate.py``, ``--speculative-disable-by-batch-size``): a step where more than N sequences decode is a
plain step (its drafts dropped, decode-mode metadata and the runner's sampling when it only decodes), and the chain
drafts only when the next step will speculate. The MTP layer's K/V must still cover every position such a step
computes (the first draft after the gate lifts attends to them): a gated step of decodes that another gated step
follows keeps its hidden rows instead (``_defer``), and their catch-up runs in one prefill-mode pass (``_flush``) before
the next step that runs a catch-up, or once more than ``DEFER_BYTES`` of rows are held; a sequence that finishes while
gated never pays for it. (A prefix-cache hit on a decoded block whose catch-up is still held reads stale draft K/V
there: drafts may differ, the output distribution never does.) ``stats()``: ``spec_accept_len``, the mean
tokens emitted per drafting sequence and verify step (accepted drafts + 1); ``spec_gated_steps``, the steps the gate
made plain.
Routing capture (routing replay) keeps the experts of the accepted inputs only. Not built (refused at start): CUDA
graphs, multi-step decode, tensor parallelism, LoRA slots, vision-language models; per request: grammars, top
log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areno.engine.logit_adjust import adjust_host
from areno.engine.scheduler import Chunk, Step
from areno.engine.sequence import Status
from areno.engine.spec_gate import resolve_gate
from areno.engine.speculative import verify_draft
from areno.engine.step_inputs import StepInputs
from areno.kernels.sampler import logits_f32, philox_bits, sampling_probs
from areno.models.mtp import build_mtp_draft

DRAFT_STREAM = 3 << 40  # Philox offset added for the draft tokens' noise (above verify_draft's streams)
DEFER_BYTES = 256 << 20  # hidden rows held for the deferred MTP catch-up of gated steps before it runs anyway


@dataclass
class Draft:
    length: int  # len(seq) when drafted: used only while the sequence still has that length
    tokens: list[int]
    probs: torch.Tensor  # [K_b, V] fp32, the draft distribution each token was drawn from


@dataclass
class Row:
    seq: object
    index: list[int]  # hidden rows of its K_b + 1 positions in the step's forward
    draft: Draft | None
    fresh_fork: bool = False  # a sample forked from its head in this step: no draft yet


def filters(top_k: list[int], top_p: list[float]) -> tuple:
    """Per-row top-k / top-p, each None when no row filters (the samplers then skip sorting the vocabulary)."""
    return (top_k if any(k > 0 for k in top_k) else None), (top_p if any(p < 1.0 for p in top_p) else None)


def check_speculative(engine) -> None:
    """Refuse what speculative decoding does not cover yet (a ValueError naming the setting)."""
    cfg, model = engine.config, engine.model
    if not getattr(model, "num_mtp_layers", 0) or getattr(model, "mtp_draft_parts", None) is None:
        raise ValueError(f"--speculative-tokens needs a model with MTP layers ({model.config.model_type}: none loaded)")
    refused = [(cfg.decode_steps > 1, "--decode-steps > 1"), (model.tp_group is not None, "--tp-size > 1"),
               (cfg.max_loras > 0, "--max-loras"), (model.is_multimodal, "a vision-language model"),
               (getattr(cfg, "kv_cache_dtype", "auto") == "fp8", "--kv-cache-dtype fp8")]
    for bad, name in refused:
        if bad:
            raise ValueError(f"--speculative-tokens with {name} is not built yet")


def spec_decoder(engine) -> SpecDecoder | None:
    """The engine's ``SpecDecoder`` for its (new) runner with ``--speculative-tokens`` (the draft built and the gate
    resolved once), else None."""
    k = engine.config.speculative_tokens
    if not k:
        return None
    check_speculative(engine)
    old = getattr(engine, "spec", None)
    return SpecDecoder(engine, k, old)


def check_request(spec, options) -> None:
    """Refuse a request speculative decoding does not serve yet (``spec``: the engine's SpecDecoder or None)."""
    if spec is not None and (options.top_logprobs or options.grammar is not None):
        raise ValueError("--speculative-tokens does not serve requests with top_logprobs or a grammar yet")


class SpecDecoder:
    """The engine's speculative steps (see the module docstring); built with the engine's runner."""

    def __init__(self, engine, k: int, old: SpecDecoder | None = None):
        """``old``: the decoder of the engine's previous runner, whose draft and gate this one keeps."""
        self.engine, self.k = engine, k
        self.draft = old.draft if old is not None else build_mtp_draft(engine.model)
        runner = engine.runner
        if runner.use_graphs:
            raise ValueError("--speculative-tokens with CUDA graphs is not built yet: add --eager-decode")
        # the MTP layer's own paged K/V: one cache layer on the runner (released with it)
        runner.mtp_cache = torch.zeros_like(runner.kv_cache[0])
        self.drafts: dict[int, Draft] = {}
        # the deferred MTP catch-up of gated steps: seq_id -> (seq, first position, hidden rows), at most defer_rows
        self.deferred: dict[int, tuple] = {}
        self.defer_rows = max(1, DEFER_BYTES // (engine.model.config.hidden_size * runner.dtype.itemsize))
        # the largest batch that speculates (None: every step does)
        self.limit = old.limit if old is not None else resolve_gate(engine.config.speculative_disable_by_batch_size,
                                                                    engine.model, k, runner.device)
        self.counts = {"verify_rows": 0, "emitted": 0, "proposed": 0, "drafted": 0, "spec_gated_steps": 0}

    @property
    def mtp_cache(self) -> torch.Tensor:
        return self.engine.runner.mtp_cache

    @property
    def mtp_kv(self) -> tuple:
        return tuple(self.mtp_cache[e] for e in range(self.mtp_cache.shape[0]))

    def stats(self) -> dict:
        """Since the engine started: ``spec_accept_len`` (tokens emitted per drafting sequence and verify step),
        ``verify_rows``, ``emitted``, ``proposed`` (draft tokens verified), ``drafted`` (drafts made),
        ``spec_gated_steps`` (steps run plain: too many sequences decoding)."""
        n = self.counts["verify_rows"]
        return {"spec_accept_len": self.counts["emitted"] / n if n else 0.0, **self.counts}

    def take_stats(self) -> dict:
        """``{"spec_accept_len": ...}`` since the last call (a rollout's), every count restarted."""
        out = {"spec_accept_len": self.stats()["spec_accept_len"]}
        self.counts = dict.fromkeys(self.counts, 0)
        return out

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self) -> list:
        e = self.engine
        if e.grammars.waiting and (failed := e.grammars.admit()):
            return failed
        step = e.scheduler.schedule(admit=True)
        if not step.chunks:
            return []
        for seq in step.preempted:  # recomputed from their prompt: what they held is gone with their blocks
            self.deferred.pop(seq.seq_id, None)
        if len(self.drafts) > len(e.scheduler.running):  # those of finished, aborted or preempted sequences
            running = {s.seq_id for s in e.scheduler.running}
            self.drafts = {i: d for i, d in self.drafts.items() if i in running}
        copies, state_copies = list(e.blocks.pending_copies), list(e.blocks.pending_state_copies)
        e.blocks.pending_copies.clear()
        e.blocks.pending_state_copies.clear()
        gated = self._gated(step)
        chunks, rows, next_known = self._plan(step, gated)
        inp = e.runner.prepare(Step(chunks, is_decode=gated and step.is_decode), [r.seq for r in rows],
                               [r.index[0] for r in rows], copies)
        inp.ids = [t for c in chunks for t in self._chunk_ids(c)]
        inp.state_copies = state_copies or None
        inp.adjust = e.runner.adjuster.plan([r.seq for r in rows])
        e.step_counts["single"] += 1
        with torch.inference_mode():
            hidden, meta, ids, pos = self._target(inp, rows)
            verified = self._verify(inp, rows, hidden)
        self._keep_routing(chunks, rows, meta, verified)
        e.scheduler.after_step(step)
        emitted = self._append(rows, verified)
        with torch.inference_mode():
            if gated and step.is_decode and not self._speculates_next():
                self._defer(chunks, hidden)
            else:
                self._flush()
                self._catch_up_and_draft(chunks, rows, emitted, hidden, meta, pos, next_known)
        return [r.seq for r in rows]

    def _gated(self, step: Step) -> bool:
        """Whether the gate makes ``step`` plain: more sequences decode in it than the limit (counted)."""
        decoding = sum(1 for c in step.chunks if c.samples and c.start == len(c.seq) - 1)
        gated = self.limit is not None and decoding > self.limit
        self.counts["spec_gated_steps"] += gated
        return gated

    def _speculates_next(self) -> bool:
        """Whether the next step will speculate: the sequences that will decode in it (the running ones with their
        prompt computed; preemption can only lower that) are within the limit."""
        if self.limit is None:
            return True
        return sum(1 for s in self.engine.scheduler.running if s.num_computed >= len(s) - 1) <= self.limit

    def _plan(self, step: Step, gated: bool = False):
        """The step's chunks extended by each drafting sequence's K_b tokens (none when ``gated``), its sampled rows,
        and for every computed position the next token when it is known before sampling (else None)."""
        e, rows, chunks, next_known, off = self.engine, [], [], [], 0
        for c in step.chunks:
            seq, kb = c.seq, 0
            d = self.drafts.pop(seq.seq_id, None) if c.samples else None
            if d is not None and not gated and d.length == len(seq) and c.start == len(seq) - 1:
                kb = len(d.tokens)
                if not e.blocks.reserve_tokens(seq, len(seq) + kb):
                    kb, d = 0, None
            else:
                d = None
            chunk = Chunk(seq, c.start, c.end + kb)
            chunk.draft = d
            chunks.append(chunk)
            n = c.end - c.start
            next_known += [seq.tokens[t + 1] if t + 1 < len(seq) else None for t in range(c.start, c.end)]
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
        head = c.seq.tokens[c.start : c.end - (len(d.tokens) if d else 0)]
        return head + (list(d.tokens) if d else [])

    def _target(self, inp: StepInputs, rows: list[Row]):
        """The target forward of the step (states of drafting hybrid rows saved first)."""
        r = self.engine.runner
        r.prologue(inp)
        if inp.copies:
            src = torch.tensor([p[0] for p in inp.copies], device=r.device)
            dst = torch.tensor([p[1] for p in inp.copies], device=r.device)
            self.mtp_cache[:, dst] = self.mtp_cache[:, src]
        self._saved = None
        drafting = [row.seq.state_slot for row in rows if row.draft is not None]
        if r.states is not None and drafting:
            slots = torch.tensor(drafting, device=r.device)
            self._saved = (slots, r.states.conv[:, slots].clone(), r.states.recurrent[:, slots].clone())
        ids, pos, meta = r.step_tensors(inp)
        if r.record_routing:
            meta.routing_out = torch.empty(self.engine.model.num_moe_layers, len(inp.ids), self.engine.model.moe_top_k,
                                           dtype=torch.int32, device=r.device)  # fmt: skip
        hidden = self.engine.model(ids, pos, kv_caches=r.kv_caches, attn_metadata=meta)
        return hidden, meta, ids, pos

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

    def _verify(self, inp: StepInputs, rows: list[Row], hidden):
        r, dev = self.engine.runner, self.engine.runner.device
        B = len(rows)
        if not B:  # prefill chunks that do not reach the end of their prompts: K/V (and the MTP's) only
            return [], [], []
        nd = [len(row.index) - 1 for row in rows]
        K = max(nd)
        if not K:  # no draft to verify (a gated step, prefills): the plain step's sampling
            toks, lps, _ = r.sample_rows(inp, hidden)
            return [[t] for t in toks.tolist()], [[lp] for lp in lps.tolist()], nd
        V = r.vocab_size
        index = torch.tensor([row.index + [row.index[-1]] * (K - len(row.index) + 1) for row in rows], device=dev)
        logits = r.logits(hidden[index.view(-1)]).view(B, K + 1, V)
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
        self._rollback(rows, out.accepted.tolist(), nd)
        return toks, lps, nd

    def _rollback(self, rows: list[Row], accepted: list[int], nd: list[int]) -> None:
        """Hybrid models: restore the saved recurrent states of the rows that rejected a draft token and run the
        target again over their accepted inputs (their K/V rewritten with the same values)."""
        if self._saved is None:
            return
        r = self.engine.runner
        slots, conv, rec = self._saved
        drafting = [b for b, row in enumerate(rows) if row.draft is not None]
        redo = [(n, b) for n, b in enumerate(drafting) if accepted[b] < nd[b]]
        if not redo:
            return
        which = torch.tensor([n for n, _ in redo], device=r.device)
        r.states.conv[:, slots[which]] = conv[:, which]
        r.states.recurrent[:, slots[which]] = rec[:, which]
        chunks = []
        for _, b in redo:
            seq, a = rows[b].seq, accepted[b]
            c = Chunk(seq, len(seq) - 1, len(seq) + a)
            c.draft = Draft(len(seq), rows[b].draft.tokens[:a], rows[b].draft.probs[:a])
            chunks.append(c)
        inp = r.prepare(Step(chunks, is_decode=False), [], [], [])
        inp.ids = [t for c in chunks for t in self._chunk_ids(c)]
        ids, pos, meta = r.step_tensors(inp)
        self.engine.model(ids, pos, kv_caches=r.kv_caches, attn_metadata=meta)

    def _append(self, rows: list[Row], verified) -> list[list[int]]:
        """Each row's emitted tokens appended up to its stop; returns them (all of them, for the MTP catch-up)."""
        e = self.engine
        toks, lps, nd = verified
        for row, t, lp, k in zip(rows, toks, lps, nd):
            if k:
                self.counts["verify_rows"] += 1
                self.counts["emitted"] += len(t)
                self.counts["proposed"] += k
            reason = e.stopper.extend(row.seq, t, lp)
            if k or len(t) > 1:
                e.scheduler.after_decode(row.seq)
            if reason is not None:
                row.seq.finish(reason)
                e.scheduler.finish(row.seq)
        return toks

    # ---- drafting ------------------------------------------------------------------------------------------
    def _defer(self, chunks, hidden) -> None:
        """A gated step of decodes only that another gated step follows: its MTP catch-up waits, each sequence's hidden
        row kept, until a step needs the draft's K/V whole (``_flush``) or more than ``defer_rows`` rows are held."""
        for i, c in enumerate(chunks):
            held = self.deferred.get(c.seq.seq_id)
            if held is not None and held[1] + len(held[2]) != c.start:  # not the position after them: keep both
                self._flush()
                held = None
            if held is None:
                held = self.deferred[c.seq.seq_id] = (c.seq, c.start, [])
            held[2].append(hidden[i])
        self.deferred = {i: d for i, d in self.deferred.items() if not d[0].is_finished}
        if sum(len(d[2]) for d in self.deferred.values()) > self.defer_rows:
            self._flush()

    def _flush(self) -> None:
        """The deferred MTP catch-up: step 0 of the draft over every held position of the running sequences in one
        prefill-mode pass, which writes the draft's K/V there (no draft is made from them: a later step's catch-up
        does that). Finished and preempted sequences' rows are dropped."""
        held = [d for d in self.deferred.values() if d[0].status is Status.RUNNING]
        self.deferred = {}
        if not held:
            return
        r = self.engine.runner
        inp = r.prepare(Step([Chunk(seq, p, p + len(h)) for seq, p, h in held], is_decode=False), [], [], [])
        _, pos, meta = r.step_tensors(inp)
        nxt = torch.tensor([seq.tokens[q + 1] for seq, p, h in held for q in range(p, p + len(h))],
                           dtype=torch.int64, device=r.device)
        hidden = torch.stack([row for _, _, h in held for row in h])
        self.draft(self.engine.model, 0, hidden, nxt, pos, meta, self.mtp_kv)

    def _catch_up_and_draft(self, chunks, rows, emitted, hidden, meta, pos, next_known) -> None:
        """MTP step 0 over every computed position (its K/V written), then the chain for live rows."""
        e, dev = self.engine, self.engine.runner.device
        nxt = list(next_known)
        for row, toks in zip(rows, emitted):
            if row.fresh_fork:
                continue
            for i, t in enumerate(toks):  # the last input position's next token is the first emitted one
                nxt[row.index[i]] = t
        nxt = torch.tensor([0 if t is None else t for t in nxt], dtype=torch.int64, device=dev)
        out, chain = self.draft(e.model, 0, hidden, nxt, pos, meta, self.mtp_kv)
        live = []  # (row, K_b, hidden row of its last accepted position)
        for row, toks in zip(rows, emitted) if self._speculates_next() else ():
            seq = row.seq
            kb = min(self.k, e.max_model_len - len(seq), seq.options.max_new_tokens - seq.num_output - 1)
            if row.fresh_fork or seq.is_finished or kb < 1 or not e.blocks.reserve_tokens(seq, len(seq) + kb):
                continue
            live.append((row, kb, row.index[len(toks) - 1]))
        if live:
            self._chain(live, out, chain)

    def _chain(self, live, out, chain) -> None:
        """Draft tokens for each live (row, K_b, hidden row of its last accepted position): step 0's output there,
        then decode steps of the MTP layer for the rows still drafting."""
        seqs, kbs = [row.seq for row, _, _ in live], [kb for _, kb, _ in live]
        pick = torch.tensor([i for _, _, i in live], device=out.device)
        o, g = out[pick], chain[pick]
        active = list(range(len(live)))  # indices into live, aligned with the rows of o and g
        toks, probs = [[] for _ in live], [[] for _ in live]
        for j in range(max(kbs)):
            if j:
                keep = [a for a, i in enumerate(active) if kbs[i] > j]
                active = [active[a] for a in keep]
                o, g = self._mtp_decode(j, [seqs[i] for i in active], g[keep], [toks[i][-1] for i in active])
            t, q = self._draw(j, [seqs[i] for i in active], o)
            for a, i in enumerate(active):
                toks[i].append(t[a])
                probs[i].append(q[a])
        for (row, _, _), tk, pr in zip(live, toks, probs):
            self.drafts[row.seq.seq_id] = Draft(len(row.seq), tk, torch.stack(pr))
            self.counts["drafted"] += 1

    def _mtp_decode(self, j: int, seqs: list, g, ids: list[int]):
        """MTP decode step j: each sequence's previous draft token at position len(seq) - 2 + j."""
        r = self.engine.runner
        chunks = [Chunk(s, len(s) - 2 + j, len(s) - 1 + j) for s in seqs]
        inp = r.prepare(Step(chunks, is_decode=True), [], [], [])
        inp.ids = ids
        tid, pos, meta = r.step_tensors(inp)
        return self.draft(self.engine.model, 0, g, tid, pos, meta, self.mtp_kv)

    def _draw(self, j: int, seqs: list, o):
        """Draft tokens from the draft logits at each sequence's request settings: (tokens [R], probs [R, V])."""
        dev = o.device
        logits = logits_f32(o, self.draft.head_weight(self.engine.model, j))
        cap = self.engine.model.logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        opts = [s.options for s in seqs]
        top_k, top_p = filters([p.top_k for p in opts], [p.top_p for p in opts])
        q = sampling_probs(logits, temperature=torch.tensor([p.temperature for p in opts], device=dev),
                           top_k=None if top_k is None else torch.tensor(top_k, device=dev),
                           top_p=None if top_p is None else torch.tensor(top_p, device=dev))
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=dev)
        offsets = torch.tensor([len(s) + j + DRAFT_STREAM for s in seqs], dtype=torch.int64, device=dev)
        u = (philox_bits(seeds, offsets, q.shape[1]).double() + 0.5) * 2.0**-32
        return (torch.log(q.double()) - torch.log(-torch.log(u))).argmax(dim=1).tolist(), q
