"""Runs the model for one scheduled step: turns it into packed inputs and attention metadata, owns the paged KV
cache, samples the next tokens, and replays CUDA graphs for pure-decode steps (one graph per batch-size bucket).

Multi-step decode (``StepInputs.decode_steps = k > 1``): k decode steps back to back on the device, each feeding
its sampled tokens to the next (positions, slots, lengths and sampler offsets advance on the device; the blocks for
all k positions are reserved beforehand), then one copy back of ``[k, rows]`` tokens. With CUDA graphs the k steps
are one graph, so the host schedules, packs inputs and synchronises once per k tokens instead of once per token.
Each step draws the same noise (seed, position) as k single steps would, so the tokens are the same.
``launch_decode_steps`` queues such a group and returns at once (its tokens come back through pinned buffers and
an event, ``wait_decode``); a group launched with ``ids_from`` takes each row's input token from an earlier,
unread group's last step on the device, so the engine can queue the next group before it reads the current one.

Logit adjustments (``StepInputs.adjust``, None when no row asks): logit_bias and the min_tokens ban of EOS and stop
ids (a sparse per-row list), repetition/presence/frequency penalties (a per-sequence slot of token counts on the
device, filled at the sequence's first sampled step and counted up by every sampled token inside the step, graphs
included), then min-p in the sampler. Graphs with adjustments are captured apart (key ``(bucket, k, width)``,
width 0 without), so a batch that uses none runs exactly the plain graph.

A step is first flattened into :class:`StepInputs` (plain lists): under tensor parallelism rank 0 schedules and
broadcasts that record, and every rank of the TP group executes it in lockstep (``TPWorker`` on the others).

KV cache layout: one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``; layer i gets the views
``cache[i, 0]`` and ``cache[i, 1]`` (a model's ``kv_cache_layout`` may say otherwise: bailing_hybrid's latent MLA
cache is ``[num_layers, 1, num_blocks, block_size, r + d_rope]``, layer i gets ``(cache[i, 0],)``).
Its size comes from a memory budget (a fraction of free GPU memory, or bytes)
capped by what ``max_running`` sequences of ``max_model_len`` tokens can use. Hybrid models: only the attention
layers (``model.kv_cache_layers``) have K/V blocks; the recurrent layers get ``max_running`` state slots
(``state_cache.py``, addressed by ``StepInputs.state_slots``; graph padding rows use slot -1), taken from the budget.

Routing capture (``record_routing``, sparse-MoE models, for routing replay in training): every step also returns the
expert ids each MoE layer chose for each token it computed, ``last_routing`` (CPU int32 ``[num_moe_layers, T, k]``,
or ``[steps, num_moe_layers, rows, k]`` for (multi-step) decode), written by the layers into a buffer that is static
under CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from areno.engine.grammar import apply_token_mask
from areno.engine.images import ImageEmbeddings, ImageStep
from areno.engine.scheduler import Step
from areno.engine.sequence import Status
from areno.engine.state_cache import RecurrentStates
from areno.kernels import sample
from areno.kernels.penalties import apply_logit_bias, apply_penalties, record_tokens, reset_token_state
from areno.kernels.sampler import _logits_f32
from areno.models.attention_metadata import AttentionMetadata
from areno.models.layers import gather_from_tp

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
SPARSE_MIN_WIDTH = 16  # the graphs' per-row logit-bias/ban list: a power of two, at least this wide


def kv_cache_layout(model) -> tuple[int, tuple[int, ...]]:
    """(tensors per cache layer, per-token shape): K and V ``[Hkv_local, head_dim]`` unless the model says otherwise
    (``model.kv_cache_layout``: bailing_hybrid's latent MLA cache is one ``[r + d_rope]`` row a token)."""
    if model.kv_cache_layout is not None:
        return model.kv_cache_layout
    return 2, (model.num_kv_heads_local, model.kv_head_dim)


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    layers = len(model.kv_cache_layers)
    n, shape = kv_cache_layout(model)
    return layers * n * block_size * math.prod(shape) * elem


def state_bytes(model, max_running: int, dtype: torch.dtype) -> int:
    """Device bytes of a hybrid model's recurrent-state slots (0 for attention-only models)."""
    shapes = model.recurrent_state_shapes()
    return max_running * RecurrentStates.bytes_per_slot(shapes, dtype) if shapes else 0


def plan_num_blocks(model, *, block_size, dtype, device, kv_cache_memory, max_running, max_model_len) -> int:
    """Blocks for the KV cache: the memory budget, capped by max_running full-length sequences."""
    per_block = kv_bytes_per_block(model, block_size, dtype)
    cap = max_running * math.ceil(max_model_len / block_size) + max_running  # + one spare per sequence
    if kv_cache_memory is None:
        kv_cache_memory = 0.5 if device.type == "cuda" else 256 * 2**20
    if kv_cache_memory <= 1.0:  # a fraction of the free device memory
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * kv_cache_memory)
        else:
            budget = int(kv_cache_memory * 2**30)
    else:
        budget = int(kv_cache_memory)
    budget -= state_bytes(model, max_running, dtype)  # the recurrent-state slots come out of the same budget
    blocks = max(1, min(cap, budget // per_block))
    if dist.is_initialized() and model.tp_group is not None:  # every TP rank the same size
        t = torch.tensor([blocks], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=model.tp_group)
        blocks = int(t.item())
    return blocks


@dataclass
class LogitAdjust:
    """A step's per-row logit adjustments (see the module docstring), one entry per sampled row."""

    slots: list[int]  # the row's token-count slot, -1: no penalties
    repetition: list[float]
    presence: list[float]
    frequency: list[float]
    min_p: list[float]
    min_left: list[int]  # output tokens still to sample before EOS and stop ids may be (min_tokens)
    sparse: list[list[tuple[int, float, bool]]]  # (token id, bias, banned while min_left > 0); distinct ids
    init: list[tuple[int, list[int], list[int]]]  # slots to fill before the step: (slot, prompt ids, output ids)

    @property
    def width(self) -> int:
        return max(map(len, self.sparse), default=0)


@dataclass
class StepInputs:
    """One step as plain lists: what TP rank 0 broadcasts and every rank executes."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    cu_q: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    is_decode: bool
    row_index: list[int]  # hidden row sampled by each output row
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int]
    offsets: list[int]
    top_logprobs: int
    copies: list[tuple[int, int]]
    decode_steps: int = 1  # > 1: multi-step decode (see the module docstring)
    adjust: LogitAdjust | None = None  # per-row logit adjustments, None when no row has any
    token_mask: tuple | None = None  # structured outputs: (rows, int32 bitmask), see areno.engine.grammar
    # prompts with images (areno.engine.images), None for text: the model's positions where they differ from the
    # cache positions ([T], or [3][T] when the step holds image tokens), decode's per-row offsets, the image work
    rope_positions: list | None = None
    rope_offsets: list[int] | None = None
    images: ImageStep | None = None
    # hybrid models: each sequence's (chunk's) recurrent-state slot, and the (src, dst) slot copies of forks
    state_slots: list[int] | None = None
    state_copies: list[tuple[int, int]] | None = None


@dataclass
class DecodeLaunch:
    """A k-step decode group queued on the device and not yet read (``ModelRunner.launch_decode_steps``)."""

    k: int
    n: int  # rows
    device_tokens: torch.Tensor | None  # [k, >= n] on the device: a later group's input ids come from its last step
    host: tuple  # (tokens int64, logprobs) [k, >= n] on the host: pinned copies in flight, or the results
    event: object = None  # a CUDA event after the copies to ``host``; None when ``host`` is ready


class ModelRunner:
    def __init__(self, model, *, num_blocks, block_size, max_model_len, max_running, eager=False, device=None,
                 eos_token_ids=(), record_routing=False):
        self.model = model
        self.device = device or next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        kv_layers = model.kv_cache_layers
        n, shape = kv_cache_layout(model)
        self.kv_cache = torch.zeros(len(kv_layers), n, num_blocks, block_size, *shape, dtype=self.dtype,
                                    device=self.device)
        self.kv_caches = [None] * model.num_layers  # per layer: (k_cache, v_cache), or a recurrent layer's pools
        for j, i in enumerate(kv_layers):
            self.kv_caches[i] = tuple(self.kv_cache[j, e] for e in range(n))
        shapes = model.recurrent_state_shapes()
        self.states = RecurrentStates(shapes, max_running, dtype=self.dtype, device=self.device) if shapes else None
        if self.states is not None:
            for i, pools in self.states.caches().items():
                self.kv_caches[i] = pools
        self.record_routing = bool(record_routing and model.is_moe)
        self.last_routing = None
        self.use_graphs = (not eager) and self.device.type == "cuda"
        self.graph_buckets = [b for b in GRAPH_BUCKETS if b <= max(1, max_running)]
        if self.graph_buckets[-1] < max_running:
            self.graph_buckets.append(max_running)
        self.graphs: dict[int, tuple] = {}
        self.graph_pool = None
        self.last_step_used_graph = False
        self._pinned: dict[tuple, list] = {}  # graph output shape -> two pinned (tokens, logprobs) pairs, alternated
        self._pinned_turn: dict[tuple, int] = {}
        self.tp_group = model.tp_group
        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        self.vocab_size = model.lm_head_weight.shape[0] * tp  # the width of the (gathered) logits
        self.eos_token_ids = sorted(set(eos_token_ids))  # banned with the stop ids before min_tokens
        self.max_running = max_running
        self.token_state = None  # [max_running, V] int32 token counts (areno.kernels.penalties), made when needed
        self._slots: dict[int, tuple] = {}  # rank 0: seq_id -> (sequence, its token-state slot)
        self._free_slots = list(range(max_running))[::-1]
        self.images = ImageEmbeddings(model) if model.is_multimodal else None  # a model with a tower

    def release(self) -> None:
        """Drop CUDA graphs and the KV cache (``--drop-rollout-state``)."""
        self.graphs.clear()
        self.graph_pool = None
        self.token_state = None
        self._slots.clear()
        self._free_slots = list(range(self.max_running))[::-1]
        if self.images is not None:
            self.images.clear()
        self.kv_cache = None
        self.kv_caches = []
        self.states = None

    # ---- step -> inputs ------------------------------------------------------------------------------------
    def prepare(self, step: Step, rows: list, row_index: list[int], copies) -> StepInputs:
        bs = self.block_size
        if step.is_decode:  # the hot path: one token per sequence
            seqs = [c.seq for c in step.chunks]
            pos = [c.start for c in step.chunks]
            offsets = None
            if self.images is not None:  # M-RoPE: a token after the prompt sits at n + rope_delta
                offsets = [0 if s.mm is None else s.mm.rope_delta for s in seqs]
                offsets = offsets if any(offsets) else None
            return StepInputs(
                ids=[s.tokens[-1] for s in seqs], positions=pos,
                slots=[s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)],
                cu_q=list(range(len(seqs) + 1)), seq_lens=[p + 1 for p in pos], tables=[s.block_table for s in seqs],
                is_decode=True, row_index=list(row_index),
                temperature=[s.options.temperature for s in rows], top_k=[s.options.top_k for s in rows],
                top_p=[s.options.top_p for s in rows], seeds=[s.seed for s in rows], offsets=[p + 1 for p in pos],
                top_logprobs=max((s.options.top_logprobs for s in rows), default=0), copies=list(copies),
                rope_offsets=offsets, state_slots=[s.state_slot for s in seqs] if self.states is not None else None,
            )
        ids, pos, slots, cu_q, seq_lens, tables = [], [], [], [0], [], []
        for c in step.chunks:
            seq, table = c.seq, c.seq.block_table
            ids.extend(seq.tokens[c.start : c.end])
            pos.extend(range(c.start, c.end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, c.end))
            cu_q.append(cu_q[-1] + c.end - c.start)
            seq_lens.append(c.end)
            tables.append(table)
        inp = StepInputs(
            ids=ids, positions=pos, slots=slots, cu_q=cu_q, seq_lens=seq_lens, tables=tables,
            is_decode=step.is_decode, row_index=list(row_index),
            temperature=[s.options.temperature for s in rows], top_k=[s.options.top_k for s in rows],
            top_p=[s.options.top_p for s in rows], seeds=[s.seed for s in rows], offsets=[len(s) for s in rows],
            top_logprobs=max((s.options.top_logprobs for s in rows), default=0), copies=list(copies),
            state_slots=[c.seq.state_slot for c in step.chunks] if self.states is not None else None,
        )
        if self.images is not None and (self.images.readers or any(c.seq.mm is not None for c in step.chunks)):
            self._prepare_images(inp, step.chunks)
        return inp

    def _prepare_images(self, inp: StepInputs, chunks) -> None:
        """A prefill step with prompts that hold images: the image work, and the model's positions ([3][T] when
        image tokens are in the step, else [T]: every other token's three streams are equal)."""
        inp.images = self.images.plan(chunks)
        if not any(c.seq.mm is not None for c in chunks):
            return
        rope = np.concatenate([np.broadcast_to(np.arange(c.start, c.end), (3, c.end - c.start)) if c.seq.mm is None
                               else c.seq.mm.rope_positions(c.start, c.end) for c in chunks], axis=1)  # fmt: skip
        inp.rope_positions = rope.tolist() if inp.images is not None and inp.images.rows else rope[0].tolist()

    def _inputs(self, step: Step, rows: list, row_index: list[int], copies, state_copies, decode_steps: int = 1,
                token_mask=None) -> StepInputs:
        """The step as :class:`StepInputs` (rank 0), sent to the other TP ranks first."""
        inp = self.prepare(step, rows, row_index, copies)
        inp.state_copies = list(state_copies) or None
        inp.adjust = self._adjust(rows)
        inp.decode_steps, inp.token_mask = decode_steps, token_mask
        if self.tp_group is not None:
            broadcast_step(inp, self.tp_group)
        return inp

    def run(self, step: Step, rows: list, row_index: list[int], copies=(), token_mask=None, state_copies=()):
        """Forward the step and sample one token for each of ``rows`` from hidden row ``row_index``.

        Returns CPU tensors (tokens int64, logprobs fp32) and, when a row asks for them, (ids, log-probs) of the
        top candidates, else None. Under TP the step goes to the other ranks first. k chained decode steps:
        :meth:`launch_decode_steps`. ``token_mask`` (grammar rows): their disallowed logits become -inf before
        sampling. ``state_copies``: recurrent-state slot copies (forks) to make before the step.
        """
        return self.execute(self._inputs(step, rows, row_index, copies, state_copies, token_mask=token_mask))

    def launch_decode_steps(self, step: Step, rows: list, k: int, copies=(), state_copies=(),
                            ids_from: tuple | None = None) -> DecodeLaunch:
        """Queue ``k`` decode steps of every row of a pure-decode ``step`` (the blocks of all k positions reserved)
        and return without waiting for them; :meth:`wait_decode` reads their tokens. ``ids_from = (launch, index)``:
        row i's input token is row ``index[i]``'s token from the last step of that earlier launch, taken on the
        device (the step's own ids are placeholders). Under TP the group runs before this returns."""
        if ids_from is not None and self.tp_group is not None:
            raise ValueError("launch_decode_steps: ids_from needs the whole model on this rank (no TP)")
        inp = self._inputs(step, rows, list(range(len(rows))), copies, state_copies, decode_steps=k)
        if self.tp_group is not None:
            return DecodeLaunch(k, len(rows), None, self.execute(inp))
        return self._launch(inp, ids_from)

    def wait_decode(self, launch: DecodeLaunch):
        """A launch's tokens (int64) and logprobs (fp32), ``[k, rows]`` CPU tensors of their own."""
        if launch.event is not None:
            launch.event.synchronize()
        tokens, logprobs = launch.host
        return tokens[:, : launch.n].clone(), logprobs[:, : launch.n].to(torch.float32, copy=True)

    # ---- execution (every TP rank) -------------------------------------------------------------------------
    def _prologue(self, inp: StepInputs) -> None:
        """What every step does before its forward: block and state copies, penalty slots."""
        self._copy_blocks(inp.copies)
        if inp.state_copies:
            self.states.copy(inp.state_copies)
        if inp.adjust is not None:
            self._fill_slots(inp.adjust)

    def _graphable(self, inp: StepInputs) -> bool:
        return (self.use_graphs and inp.is_decode and not inp.top_logprobs and inp.token_mask is None
                and len(inp.seq_lens) <= self.graph_buckets[-1])

    @torch.inference_mode()
    def _launch(self, inp: StepInputs, ids_from: tuple | None) -> DecodeLaunch:
        self._prologue(inp)
        self.last_step_used_graph = self._graphable(inp)
        if self.last_step_used_graph:
            return self._launch_graph(inp, ids_from)
        return self._launch_eager(inp, ids_from)

    @torch.inference_mode()
    def execute(self, inp: StepInputs):
        self._prologue(inp)
        if self._graphable(inp):
            self.last_step_used_graph = True
            return self._run_graph(inp)
        self.last_step_used_graph = False
        if inp.decode_steps > 1:
            return self.wait_decode(self._launch_eager(inp, None))
        ids, pos, meta = self._tensors(inp)
        if self.record_routing:
            meta.routing_out = torch.empty(self.model.num_moe_layers, len(inp.ids), self.model.moe_top_k,
                                           dtype=torch.int32, device=self.device)
        if inp.images is None:
            hidden = self.model(ids, pos, kv_caches=self.kv_caches, attn_metadata=meta)
        else:  # the tower runs here for new images; each chunk takes its rows of the embeddings
            hidden = self.model(ids, pos, kv_caches=self.kv_caches, attn_metadata=meta,
                                **self.images.inputs(inp.images, self.device))
            self.images.release(inp.images)
        self.last_routing = meta.routing_out.cpu() if self.record_routing else None
        if not inp.row_index:  # a prefill chunk that does not reach the end of its prompt: K/V only
            return torch.empty(0, dtype=torch.int64), torch.empty(0), None
        idx = torch.tensor(inp.row_index, dtype=torch.int64, device=self.device)
        params = self._sampling(inp, self.device)
        logits = self.logits(hidden[idx])
        if inp.token_mask is not None:
            apply_token_mask(logits, inp.token_mask)
        adj = None
        if inp.adjust is not None:
            host = self._adjust_host(inp.adjust, len(inp.row_index), inp.adjust.width)
            adj = {name: val.to(self.device, non_blocking=True) for name, val in host.items()}
            self._apply_adjust(logits, adj, adj["min_left"])
        tokens, logprobs = sample(logits, temperature=params[0], top_k=params[1], top_p=params[2],
                                  seeds=params[3], offsets=params[4], min_p=None if adj is None else adj["min_p"])
        if adj is not None and "pen_slot" in adj:
            record_tokens(self.token_state, adj["pen_slot"], tokens)
        top = None
        if inp.top_logprobs:  # the same tempered distribution as the returned log-probs (T = 0 counts as 1)
            temp = torch.where(params[0] > 0, params[0], torch.ones_like(params[0]))
            lp = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
            vals, ids_ = lp.topk(inp.top_logprobs, dim=-1)
            top = (ids_.cpu(), vals.cpu())
        return tokens.cpu(), logprobs.float().cpu(), top

    def logits(self, hidden):
        """fp32 logits (an fp32-output GEMM: bf16 logits would round the log-probs by up to ~0.1 nats), gathered
        over the vocab shards under TP."""
        local = _logits_f32(hidden, self.model.lm_head_weight)
        return gather_from_tp(local, self.tp_group) if self.tp_group is not None else local

    def _copy_blocks(self, pairs) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # ---- logit adjustments ---------------------------------------------------------------------------------
    def _adjust(self, rows) -> LogitAdjust | None:
        """The rows' logit adjustments (rank 0). A penalised sequence takes a token-state slot at its first sampled
        step and gives it back once it no longer runs (finished, aborted or preempted: refilled on its return)."""
        if self._slots:
            self._release_slots(rows)
        if not any(s.options.adjusts_logits for s in rows):
            return None
        adj = LogitAdjust([], [], [], [], [], [], [], [])
        for seq in rows:
            o = seq.options
            slot = -1
            if o.penalized:
                held = self._slots.get(seq.seq_id)
                if held is None:
                    if not self._free_slots:
                        raise RuntimeError("no token-state slot free: more penalised sequences than max_running")
                    slot = self._free_slots.pop()
                    self._slots[seq.seq_id] = (seq, slot)
                    adj.init.append((slot, seq.tokens[: seq.prompt_len], seq.tokens[seq.prompt_len :]))
                else:
                    slot = held[1]
            left = max(0, o.min_new_tokens - seq.num_output)
            entries = {t: (b, False) for t, b in o.logit_bias.items()}
            if left:
                for t in o.stop_token_ids + ([] if o.ignore_eos else self.eos_token_ids):
                    entries[t] = (entries.get(t, (0.0, False))[0], True)
            adj.slots.append(slot)
            adj.repetition.append(o.repetition_penalty)
            adj.presence.append(o.presence_penalty)
            adj.frequency.append(o.frequency_penalty)
            adj.min_p.append(o.min_p)
            adj.min_left.append(left)
            adj.sparse.append([(t, b, ban) for t, (b, ban) in entries.items()])
        if max(adj.slots) < 0 and not any(adj.min_p) and not adj.width:
            return None  # only a min_tokens that is already reached
        return adj

    def _release_slots(self, rows) -> None:
        current = {s.seq_id for s in rows}
        for seq_id, (seq, slot) in list(self._slots.items()):
            if seq.status is not Status.RUNNING and seq_id not in current:
                del self._slots[seq_id]
                self._free_slots.append(slot)

    def _token_state(self) -> torch.Tensor:
        if self.token_state is None:
            self.token_state = torch.zeros(self.max_running, self.vocab_size, dtype=torch.int32, device=self.device)
        return self.token_state

    def _fill_slots(self, adj: LogitAdjust) -> None:
        """Every rank: the token counts of the sequences that took a slot at this step."""
        for slot, prompt, output in adj.init:
            reset_token_state(self._token_state(), slot, prompt, output)

    @staticmethod
    def _adjust_host(adj: LogitAdjust, bsz: int, width: int, penalties: bool | None = None) -> dict:
        """The adjustments as host tensors, padded to ``bsz`` rows and ``width`` sparse entries; the penalty
        entries only with ``penalties`` (default: when some row has a slot)."""
        pad = bsz - len(adj.slots)
        ids = np.full((bsz, width), -1, dtype=np.int64)
        bias = np.zeros((bsz, width), dtype=np.float32)
        ban = np.zeros((bsz, width), dtype=np.bool_)
        for i, entries in enumerate(adj.sparse):
            for j, (t, b, banned) in enumerate(entries):
                ids[i, j], bias[i, j], ban[i, j] = t, b, banned
        host = {"min_p": torch.tensor(adj.min_p + [0.0] * pad, dtype=torch.float32),
                "min_left": torch.tensor(adj.min_left + [0] * pad, dtype=torch.int32),
                "sp_ids": torch.from_numpy(ids), "sp_bias": torch.from_numpy(bias), "sp_ban": torch.from_numpy(ban)}
        if penalties or (penalties is None and max(adj.slots) >= 0):
            host.update(pen_slot=torch.tensor(adj.slots + [-1] * pad, dtype=torch.int64),
                        rep=torch.tensor(adj.repetition + [1.0] * pad, dtype=torch.float32),
                        pres=torch.tensor(adj.presence + [0.0] * pad, dtype=torch.float32),
                        freq=torch.tensor(adj.frequency + [0.0] * pad, dtype=torch.float32))
        return host

    def _apply_adjust(self, logits, adj: dict, min_left) -> None:
        """In place on fp32 logits: logit_bias and the min_tokens ban, then the penalties (vLLM's order)."""
        if adj["sp_ids"].shape[1]:
            apply_logit_bias(logits, adj["sp_ids"], adj["sp_bias"], adj["sp_ban"], min_left)
        if "pen_slot" in adj:
            apply_penalties(logits, adj["pen_slot"], self._token_state(), adj["rep"], adj["pres"], adj["freq"])

    def _tensors(self, inp: StepInputs):
        dev = self.device
        t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=dev)  # noqa: E731
        width = max(len(tb) for tb in inp.tables)  # eager steps: only as wide as needed
        tables = [tb + [0] * (width - len(tb)) for tb in inp.tables]
        cu_k = [0]
        for n in inp.seq_lens:
            cu_k.append(cu_k[-1] + n)
        q_lens = [b - a for a, b in zip(inp.cu_q, inp.cu_q[1:])]
        has_prefix = any(n > q for n, q in zip(inp.seq_lens, q_lens))
        meta = AttentionMetadata(
            slot_mapping=t(inp.slots, torch.int64), is_prefill=not inp.is_decode, cu_seqlens_q=t(inp.cu_q),
            cu_seqlens_k=t(cu_k), max_seqlen_q=max(q_lens), max_seqlen_k=max(inp.seq_lens), block_table=t(tables),
            seq_lens=t(inp.seq_lens), has_prefix=has_prefix,
            state_indices=None if inp.state_slots is None else t(inp.state_slots),
        )
        if inp.rope_positions is not None:
            pos = inp.rope_positions
        elif inp.rope_offsets is not None:
            pos = [p + o for p, o in zip(inp.positions, inp.rope_offsets)]
        else:
            pos = inp.positions
        return t(inp.ids, torch.int64), t(pos, torch.int64), meta

    @staticmethod
    def _sampling(inp: StepInputs, device):
        """Per-row sampling settings; the offset (the token's position) makes each step draw fresh noise."""
        out = (torch.tensor(inp.temperature, dtype=torch.float32), torch.tensor(inp.top_k, dtype=torch.int64),
               torch.tensor(inp.top_p, dtype=torch.float32), torch.tensor(inp.seeds, dtype=torch.int64),
               torch.tensor(inp.offsets, dtype=torch.int64))
        return [x.to(device, non_blocking=True) for x in out]

    # ---- CUDA graphs for decode ----------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        return next(b for b in self.graph_buckets if b >= n)

    def decode_steps(self, buf: dict, k: int):
        """``k`` chained decode steps from the inputs in ``buf`` (device tensors, see ``_capture``); no host sync.
        Rows whose slot is -1 (graph padding) stay put and write nothing. Returns tokens/logprobs ``[k, rows]``.
        ``buf["rope_off"]`` (prompts with images): the model's position is the cache position plus the row's offset."""
        ids, pos, slots, lens, offsets = buf["ids"], buf["pos"], buf["slots"], buf["lens"], buf["offsets"]
        table, bs = buf["table"], self.block_size
        if self.record_routing and "routing" not in buf:  # made on the first (warm-up) call: static in the graph
            buf["routing"] = torch.empty(k, self.model.num_moe_layers, ids.shape[0], self.model.moe_top_k,
                                         dtype=torch.int32, device=ids.device)
        live = (slots >= 0).long()
        adjust, min_left = "sp_ids" in buf, buf.get("min_left")
        tokens, logprobs = [], []
        for i in range(k):
            if i:  # the next position of every live row, its slot from the (reserved) block table
                ids, pos, offsets, lens = tokens[-1], pos + live, offsets + live, lens + live.int()
                min_left = min_left - live.int() if adjust else None
                block = table.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long()
                slots = torch.where(live.bool(), block * bs + pos % bs, torch.full_like(slots, -1))
            meta = AttentionMetadata(
                slot_mapping=slots, is_prefill=False, cu_seqlens_q=buf["cu"], cu_seqlens_k=None, max_seqlen_q=1,
                max_seqlen_k=table.shape[1] * bs, block_table=table, seq_lens=lens, has_prefix=False,
                state_indices=buf.get("state_idx"), routing_out=buf["routing"][i] if "routing" in buf else None,
            )
            rope = pos + buf["rope_off"] if "rope_off" in buf else pos
            hidden = self.model(ids, rope, kv_caches=self.kv_caches, attn_metadata=meta)
            logits = self.logits(hidden)
            if adjust:
                self._apply_adjust(logits, buf, min_left)
            tok, lp = sample(logits, temperature=buf["temp"], top_k=buf["top_k"], top_p=buf["top_p"],
                             seeds=buf["seeds"], offsets=offsets, min_p=buf["min_p"] if adjust else None)
            if adjust and "pen_slot" in buf:
                record_tokens(self.token_state, buf["pen_slot"], tok)
            tokens.append(tok)
            logprobs.append(lp)
        return torch.stack(tokens), torch.stack(logprobs)

    def _graph_buffers(self, bsz: int, width: int = 0, rope_off: bool = False) -> dict:
        """The static inputs of a graph of ``bsz`` rows (``width`` > 0: with logit adjustments that wide;
        ``rope_off``: with per-row position offsets, for prompts with images)."""
        dev, mb = self.device, self.max_blocks_per_seq
        buf = {
            "ids": torch.zeros(bsz, dtype=torch.int64, device=dev),
            "pos": torch.zeros(bsz, dtype=torch.int64, device=dev),
            "slots": torch.full((bsz,), -1, dtype=torch.int64, device=dev),
            "table": torch.zeros(bsz, mb, dtype=torch.int32, device=dev),
            "lens": torch.ones(bsz, dtype=torch.int32, device=dev),
            "cu": torch.arange(bsz + 1, dtype=torch.int32, device=dev),
            "temp": torch.ones(bsz, dtype=torch.float32, device=dev),
            "top_k": torch.zeros(bsz, dtype=torch.int64, device=dev),
            "top_p": torch.ones(bsz, dtype=torch.float32, device=dev),
            "seeds": torch.zeros(bsz, dtype=torch.int64, device=dev),
            "offsets": torch.zeros(bsz, dtype=torch.int64, device=dev),
        }
        if rope_off:
            buf["rope_off"] = torch.zeros(bsz, dtype=torch.int64, device=dev)
        if self.states is not None:
            buf["state_idx"] = torch.full((bsz,), -1, dtype=torch.int32, device=dev)
        if width:  # logit adjustments: neutral values until a step copies its own in
            self._token_state()
            buf.update({name: val.to(dev) for name, val in self._adjust_host(
                LogitAdjust([], [], [], [], [], [], [], []), bsz, width, penalties=True).items()})
        return buf

    def _capture(self, bsz: int, k: int, width: int = 0, rope_off: bool = False):
        buf = self._graph_buffers(bsz, width, rope_off)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up (Triton autotune, allocator) outside the graph
                self.decode_steps(buf, k)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = self.decode_steps(buf, k)
        if self.graph_pool is None:
            self.graph_pool = graph.pool()
        self.graphs[_graph_key(bsz, k, width, rope_off)] = (graph, buf, out)

    @torch.inference_mode()
    def capture_graphs(self, decode_steps=(1,)) -> int:
        """Capture the plain decode graph of every batch-size bucket for each k in ``decode_steps`` now (a server
        does this at start: a graph captured on first use stalls that step by the capture's time). Returns how many
        were captured; none without graphs."""
        if not self.use_graphs:
            return 0
        todo = [(b, k) for k in decode_steps for b in self.graph_buckets
                if _graph_key(b, k, 0, False) not in self.graphs]
        for bsz, k in todo:
            self._capture(bsz, k)
        return len(todo)

    def warm_kernels(self) -> int:
        """Compile every paged-attention variant each distinct KV-cache layout can pick (``warm_paged_attention``);
        returns how many ran."""
        from areno.kernels.paged_attention import warm_paged_attention

        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        heads = self.model.config.num_heads // tp
        seen, runs = set(), 0
        for entry in self.kv_caches:
            if not (isinstance(entry, tuple) and len(entry) == 2 and entry[0].dim() == 4):
                continue  # a recurrent layer's state pools
            key = (tuple(entry[0].shape[1:]), entry[0].dtype)
            if key not in seen:
                seen.add(key)
                runs += warm_paged_attention(entry[0], entry[1], heads)
        return runs

    def _run_graph(self, inp: StepInputs):
        tokens, logprobs = self.wait_decode(self._launch_graph(inp, None))
        return (tokens, logprobs) if inp.decode_steps > 1 else (tokens[0], logprobs[0], None)

    def _launch_graph(self, inp: StepInputs, ids_from: tuple | None) -> DecodeLaunch:
        """Replay the bucket's graph on ``inp`` and queue the copies of its tokens to pinned host buffers."""
        n, k = len(inp.seq_lens), inp.decode_steps
        bsz = self._bucket(n)
        width = 0 if inp.adjust is None else max(SPARSE_MIN_WIDTH, 1 << (inp.adjust.width - 1).bit_length())
        rope_off = inp.rope_offsets is not None
        key = _graph_key(bsz, k, width, rope_off)
        if key not in self.graphs:
            self._capture(bsz, k, width, rope_off=True) if rope_off else self._capture(bsz, k, width)
        graph, buf, (tokens, logprobs) = self.graphs[key]
        for name, val in self._graph_host(inp, bsz, sparse_width=width).items():
            buf[name].copy_(val, non_blocking=True)
        if ids_from is not None:
            buf["ids"][:n].copy_(self._ids_from(ids_from))
        graph.replay()
        self.last_routing = buf["routing"][:, :, :n].cpu() if self.record_routing else None
        if tokens.device.type != "cuda":  # graphs stood in for on the CPU (capture tests)
            return DecodeLaunch(k, n, tokens, (tokens.clone(), logprobs.clone()))
        host = self._pinned_pair(tokens, logprobs)
        host[0].copy_(tokens, non_blocking=True)
        host[1].copy_(logprobs, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return DecodeLaunch(k, n, tokens, host, event)

    def _pinned_pair(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple:
        """Pinned host buffers for a graph's outputs: two pairs per shape, taken in turn (at most two launches are
        unread at a time, and consecutive launches of one graph take different pairs)."""
        key = (tuple(tokens.shape), tokens.dtype, logprobs.dtype)
        pairs = self._pinned.setdefault(key, [])
        turn = self._pinned_turn.get(key, 0)
        self._pinned_turn[key] = turn ^ 1
        if len(pairs) <= turn:
            pairs.append((torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True),
                          torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)))
        return pairs[turn]

    def _ids_from(self, ids_from: tuple) -> torch.Tensor:
        """Each row's input token from an earlier launch's last step: ``(launch, index)`` -> device int64 [rows]."""
        prev, index = ids_from
        idx = torch.tensor(index, dtype=torch.int64).to(self.device, non_blocking=True)
        return prev.device_tokens[prev.k - 1].index_select(0, idx)

    def _launch_eager(self, inp: StepInputs, ids_from: tuple | None) -> DecodeLaunch:
        """Multi-step decode without graphs (CPU, ``--eager-decode``): the same device loop, unpadded."""
        n = len(inp.seq_lens)
        host = self._graph_host(inp, n, width=max(len(tb) for tb in inp.tables))
        buf = {name: val.to(self.device) for name, val in host.items()}
        buf["cu"] = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        if ids_from is not None:
            buf["ids"] = self._ids_from(ids_from)
        tokens, logprobs = self.decode_steps(buf, inp.decode_steps)
        self.last_routing = buf["routing"].cpu() if self.record_routing else None
        return DecodeLaunch(inp.decode_steps, n, tokens, (tokens.cpu(), logprobs.float().cpu()))

    def _graph_host(self, inp: StepInputs, bsz: int, width: int | None = None, sparse_width: int | None = None):
        """The graph's inputs on the host, padded to the bucket (padding rows write nowhere and read one slot);
        the block table ``width`` blocks wide (default: the graphs' full width); with logit adjustments, their
        sparse lists ``sparse_width`` wide and every entry a graph has (default: as wide and as many as needed)."""
        pad = bsz - len(inp.seq_lens)
        table = np.zeros((bsz, width or self.max_blocks_per_seq), dtype=np.int32)  # numpy: cheap per-row fills
        for i, tb in enumerate(inp.tables):
            table[i, : len(tb)] = tb
        host = {
            "ids": torch.tensor(inp.ids + [0] * pad), "pos": torch.tensor(inp.positions + [0] * pad),
            "slots": torch.tensor(inp.slots + [-1] * pad), "table": torch.from_numpy(table),
            "lens": torch.tensor(inp.seq_lens + [1] * pad, dtype=torch.int32),
            "temp": torch.tensor(inp.temperature + [1.0] * pad, dtype=torch.float32),
            "top_k": torch.tensor(inp.top_k + [0] * pad), "top_p": torch.tensor(inp.top_p + [1.0] * pad),
            "seeds": torch.tensor(inp.seeds + [0] * pad), "offsets": torch.tensor(inp.offsets + [0] * pad),
        }
        if inp.rope_offsets is not None:
            host["rope_off"] = torch.tensor(inp.rope_offsets + [0] * pad)
        if inp.state_slots is not None:
            host["state_idx"] = torch.tensor(inp.state_slots + [-1] * pad, dtype=torch.int32)
        if inp.adjust is not None:
            graph = sparse_width is not None
            host.update(self._adjust_host(inp.adjust, bsz, sparse_width if graph else inp.adjust.width,
                                          penalties=True if graph else None))
        return host


def _graph_key(bsz: int, k: int, width: int, rope_off: bool) -> tuple:
    """A graph's key: (rows, chained steps, logit-adjustment width), plus a mark for per-row position offsets
    (graphs without offsets, all of a text-only model's, do no extra work)."""
    return (bsz, k, width, "rope_off") if rope_off else (bsz, k, width)


# ---- tensor parallelism: rank 0 schedules, the others follow -------------------------------------------------
def broadcast_step(inp: StepInputs | None, group) -> StepInputs | None:
    """Send (rank 0) or receive (others) one step; ``None`` tells the followers to stop."""
    box = [inp]
    src = dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class TPWorker:
    """A non-zero TP rank of an engine: executes whatever rank 0 broadcasts until told to stop: steps, or a callable
    run with this rank's runner (``areno.serve.scoring.PromptForward``)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def loop(self) -> None:
        while True:
            inp = broadcast_step(None, self.runner.tp_group)
            if inp is None:
                return
            if not isinstance(inp, StepInputs):  # other work rank 0 broadcast (prompt log-probs): it runs itself
                inp(self.runner)
                continue
            self.runner.execute(inp)
