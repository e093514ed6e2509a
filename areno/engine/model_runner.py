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
``cache[i, 0]`` and ``cache[i, 1]`` (``--kv-cache-dtype fp8``: the tensor is float8_e4m3fn and ``kv_scales``
``[num_layers, 2, num_blocks, block_size, kv_heads]`` fp32 lies beside it, layer i getting
``(cache[i, 0], cache[i, 1], scales[i, 0], scales[i, 1])``; block copies copy the scales too; a model's
``kv_cache_layout`` may say otherwise: bailing_hybrid's latent MLA cache is
``[num_layers, 1, num_blocks, block_size, r + d_rope]``, layer i gets ``(cache[i, 0],)``). With sliding-window
layers (several KV-cache groups, ``kv_cache.kv_groups``) the first dimension is the group size instead: the j-th
layer of every group gets ``cache[j, ...]``, and each group addresses its own blocks through its own block table
and slots (``AttentionMetadata.for_layer``).
Its size comes from a memory budget (a fraction of free GPU memory, or bytes)
capped by what ``max_running`` sequences of ``max_model_len`` tokens can use. Hybrid models: only the attention
layers (``model.kv_cache_layers``) have K/V blocks; the recurrent layers get ``max_running`` state slots
(``state_cache.py``, addressed by ``StepInputs.state_slots``; graph padding rows use slot -1), taken from the budget;
their delta-rule states are ``state_dtype`` (--mamba-ssm-cache-dtype: fp32, or bf16 read and written by the layers'
kernels with fp32 math).

Routing capture (``record_routing``, sparse-MoE models, for routing replay in training): every step also returns the
expert ids each MoE layer chose for each token it computed, ``last_routing`` (CPU int32 ``[num_moe_layers, T, k]``,
or ``[steps, num_moe_layers, rows, k]`` for (multi-step) decode), written by the layers into a buffer that is static
under CUDA graphs.

The runner's concerns live in their own modules: ``kv_cache`` (the cache's layout and size), ``step_inputs`` (the
step records), ``logit_adjust`` (the adjustments and token-count slots), ``decode_graphs`` (the decode graphs and the
k-step device loop, a mixin of ``ModelRunner``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from areno.engine.decode_graphs import DecodeGraphs, graph_plan
from areno.engine.grammar import apply_token_mask
from areno.engine.images import ImageEmbeddings
from areno.engine.kv_cache import kv_cache_layout, kv_groups, kv_scale_shape
from areno.engine.logit_adjust import LogitAdjuster, adjust_host
from areno.engine.scheduler import Step
from areno.engine.state_cache import RecurrentStates
from areno.engine.step_inputs import DecodeLaunch, StepInputs, host_tensor, unused_filters
from areno.kernels.fp8 import FP8
from areno.kernels.sampler import logits_f32, sample
from areno.models.attention_metadata import AttentionMetadata
from areno.models.layers import gather_from_tp


class ModelRunner(DecodeGraphs):
    def __init__(self, model, *, num_blocks, block_size, max_model_len, max_running, eager=False, device=None,
                 eos_token_ids=(), record_routing=False, lora=None, kv_dtype=None, state_dtype=torch.float32):
        self.model = model
        self.lora = lora  # LoraSlots, or None: no adapters served
        self.device = device or next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        n, shape = kv_cache_layout(model)
        groups = kv_groups(model, max_model_len)
        self.group_windows = [g.window for g in groups]
        dims = (max(len(g.layers) for g in groups), n, num_blocks, block_size)
        self.kv_cache = torch.zeros(*dims, *shape, dtype=kv_dtype or self.dtype, device=self.device)
        fp8 = self.kv_cache.dtype == FP8  # --kv-cache-dtype fp8: a scale per (slot, KV head) beside each tensor
        self.kv_scales = torch.zeros(*dims, *kv_scale_shape(model), device=self.device) if fp8 else None
        self.kv_caches = [None] * model.num_layers  # per layer: (k_cache, v_cache[, scales]), or recurrent pools
        self.layer_groups = [0] * model.num_layers if len(groups) > 1 else None  # per layer: its KV-cache group
        for g, group in enumerate(groups):
            for j, i in enumerate(group.layers):
                scales = tuple(self.kv_scales[j, e] for e in range(n)) if fp8 else ()
                self.kv_caches[i] = tuple(self.kv_cache[j, e] for e in range(n)) + scales
                if self.layer_groups is not None:
                    self.layer_groups[i] = g
        shapes = model.recurrent_state_shapes()
        self.states = RecurrentStates(shapes, max_running, dtype=self.dtype, device=self.device,
                                      state_dtype=state_dtype) if shapes else None
        if self.states is not None:
            for i, pools in self.states.caches().items():
                self.kv_caches[i] = pools
        self.record_routing = bool(record_routing and model.is_moe)
        self.last_routing = None
        self.keep_hidden = False  # decode launches keep each step's hidden rows in ``last_hidden`` [k, rows, H]
        self.last_hidden = None  # (speculation's gated chains: a graph's static buffer, read before the next replay)
        self.use_graphs, self.graph_buckets = graph_plan(max_running, eager, self.device)
        self.graphs: dict[int, tuple] = {}
        self.graph_pool = None
        self.last_step_used_graph = False
        self._pinned: dict[tuple, list] = {}  # graph output shape -> two pinned (tokens, logprobs) pairs, alternated
        self._pinned_turn: dict[tuple, int] = {}
        self.tp_group = model.tp_group
        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        self.vocab_size = model.lm_head_weight.shape[0] * tp  # the width of the (gathered) logits
        self.max_running = max_running
        self.adjuster = LogitAdjuster(max_running, self.vocab_size, self.device, eos_token_ids)
        self.images = ImageEmbeddings(model) if model.is_multimodal else None  # a model with a tower

    def release(self) -> None:
        """Drop CUDA graphs and the KV cache (``--drop-rollout-state``)."""
        self.graphs.clear()
        self.graph_pool = None
        self.adjuster.reset()
        if self.images is not None:
            self.images.clear()
        self.kv_cache = self.kv_scales = None
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
            inp = StepInputs(
                ids=[s.tokens[-1] for s in seqs], positions=pos,
                slots=[s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)],
                cu_q=list(range(len(seqs) + 1)), seq_lens=[p + 1 for p in pos], tables=[s.block_table for s in seqs],
                is_decode=True, row_index=list(row_index),
                temperature=[s.options.temperature for s in rows], top_k=[s.options.top_k for s in rows],
                top_p=[s.options.top_p for s in rows], seeds=[s.seed for s in rows], offsets=[p + 1 for p in pos],
                top_logprobs=max((s.options.top_logprobs for s in rows), default=0), copies=list(copies),
                rope_offsets=offsets, state_slots=[s.state_slot for s in seqs] if self.states is not None else None,
            )
            if self.layer_groups is not None:
                self._group_inputs(inp, seqs, [(p, p + 1) for p in pos])
            if self.lora is not None and any(s.lora_slot >= 0 for s in seqs):
                inp.lora = [s.lora_slot for s in seqs]
            return inp
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
        if self.layer_groups is not None:
            self._group_inputs(inp, [c.seq for c in step.chunks], [(c.start, c.end) for c in step.chunks])
        if self.lora is not None and any(c.seq.lora_slot >= 0 for c in step.chunks):
            inp.lora = [c.seq.lora_slot for c in step.chunks for _ in range(c.start, c.end)]
        if self.images is not None and (self.images.readers or any(c.seq.mm is not None for c in step.chunks)):
            self._prepare_images(inp, step.chunks)
        return inp

    def _group_inputs(self, inp: StepInputs, seqs: list, spans: list[tuple[int, int]]) -> None:
        """The block tables and slots of KV-cache groups 1.. (sliding-window layers): each group's own blocks."""
        bs = self.block_size
        inp.group_tables = [[s.tables[g] for s in seqs] for g in range(1, len(self.group_windows))]
        inp.group_slots = [[tb[p // bs] * bs + p % bs for tb, (a, b) in zip(tables, spans) for p in range(a, b)]
                           for tables in inp.group_tables]

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
        inp.adjust = self.adjuster.plan(rows)
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
    def prologue(self, inp: StepInputs) -> None:
        """What every step does before its forward: block and state copies, penalty slots."""
        self._copy_blocks(inp.copies)
        if inp.state_copies:
            self.states.copy(inp.state_copies)
        if inp.adjust is not None:
            self.adjuster.fill(inp.adjust)

    def _graphable(self, inp: StepInputs) -> bool:
        return (self.use_graphs and inp.is_decode and not inp.top_logprobs and inp.token_mask is None
                and len(inp.seq_lens) <= self.graph_buckets[-1])

    @torch.inference_mode()
    def _launch(self, inp: StepInputs, ids_from: tuple | None) -> DecodeLaunch:
        self.prologue(inp)
        self.last_step_used_graph = self._graphable(inp)
        if self.last_step_used_graph:
            return self._launch_graph(inp, ids_from)
        return self._launch_eager(inp, ids_from)

    @torch.inference_mode()
    def execute(self, inp: StepInputs):
        self.prologue(inp)
        if self._graphable(inp):
            self.last_step_used_graph = True
            return self._run_graph(inp)
        self.last_step_used_graph = False
        if inp.decode_steps > 1:
            return self.wait_decode(self._launch_eager(inp, None))
        ids, pos, meta = self.step_tensors(inp)
        if self.record_routing:
            meta.routing_out = torch.empty(self.model.num_moe_layers, len(inp.ids), self.model.moe_top_k,
                                           dtype=torch.int32, device=self.device)
        if self.lora is not None and inp.lora is not None:
            self.lora.index = torch.tensor(inp.lora, dtype=torch.int32, device=self.device)
        try:
            if inp.images is None:
                hidden = self.model(ids, pos, kv_caches=self.kv_caches, attn_metadata=meta)
            else:  # the tower runs here for new images; each chunk takes its rows of the embeddings
                hidden = self.model(ids, pos, kv_caches=self.kv_caches, attn_metadata=meta,
                                    **self.images.inputs(inp.images, self.device))
                self.images.release(inp.images)
        finally:
            if self.lora is not None:
                self.lora.index = None
        self.last_routing = meta.routing_out.cpu() if self.record_routing else None
        return self.sample_rows(inp, hidden)

    def sample_rows(self, inp: StepInputs, hidden):
        """The step's sampling after its forward: one token for each row of ``inp`` from hidden row
        ``inp.row_index[i]`` (logit adjustments, grammar mask, top log-probs), as :meth:`execute` returns them."""
        if not inp.row_index:  # a prefill chunk that does not reach the end of its prompt: K/V only
            return torch.empty(0, dtype=torch.int64), torch.empty(0), None
        idx = torch.tensor(inp.row_index, dtype=torch.int64, device=self.device)
        params = self._sampling(inp, self.device)
        logits = self.logits(hidden[idx])
        if inp.token_mask is not None:
            apply_token_mask(logits, inp.token_mask)
        adj = None
        if inp.adjust is not None:
            host = adjust_host(inp.adjust, len(inp.row_index), inp.adjust.width)
            adj = {name: val.to(self.device, non_blocking=True) for name, val in host.items()}
            self.adjuster.apply(logits, adj, adj["min_left"])
        tokens, logprobs = sample(logits, temperature=params[0], top_k=params[1], top_p=params[2],
                                  seeds=params[3], offsets=params[4], min_p=None if adj is None else adj["min_p"])
        if adj is not None:
            self.adjuster.record(adj, tokens)
        top = None
        if inp.top_logprobs:  # the same tempered distribution as the returned log-probs (T = 0 counts as 1)
            temp = torch.where(params[0] > 0, params[0], torch.ones_like(params[0]))
            lp = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
            vals, ids_ = lp.topk(inp.top_logprobs, dim=-1)
            top = (ids_.cpu(), vals.cpu())
        return tokens.cpu(), logprobs.float().cpu(), top

    def logits(self, hidden, weight=None):
        """fp32 logits (an fp32-output GEMM: bf16 logits would round the log-probs by up to ~0.1 nats), gathered
        over the vocab shards under TP; ``weight``: another head sharded like the model's (the MTP draft's)."""
        local = logits_f32(hidden, self.model.lm_head_weight if weight is None else weight)
        cap = self.model.logit_softcap  # Gemma 4: cap * tanh(logits / cap), elementwise (any vocab shard)
        if cap is not None:
            local = torch.tanh(local / cap) * cap
        return gather_from_tp(local, self.tp_group) if self.tp_group is not None else local

    def _copy_blocks(self, pairs) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        cache = self.kv_cache.view(torch.uint8) if self.kv_scales is not None else self.kv_cache  # (no fp8 index_put)
        cache[:, :, dst] = cache[:, :, src]
        if self.kv_scales is not None:  # an FP8 cache's blocks carry their scales
            self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]

    def step_tensors(self, inp: StepInputs):
        dev = self.device
        t = lambda x, dt=torch.int32: host_tensor(x, dt).to(dev)  # noqa: E731
        width = max(len(tb) for tables in [inp.tables, *(inp.group_tables or [])] for tb in tables)  # as needed
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
        if inp.group_tables is not None:
            meta.layer_groups = self.layer_groups
            meta.group_slot_mappings = [t(x, torch.int64) for x in inp.group_slots]
            meta.group_block_tables = [t([tb + [0] * (width - len(tb)) for tb in x]) for x in inp.group_tables]
        if inp.rope_positions is not None:
            pos = inp.rope_positions
        elif inp.rope_offsets is not None:
            pos = [p + o for p, o in zip(inp.positions, inp.rope_offsets)]
        else:
            pos = inp.positions
        return t(inp.ids, torch.int64), t(pos, torch.int64), meta

    @staticmethod
    def _sampling(inp: StepInputs, device):
        """Per-row sampling settings; the offset (the token's position) makes each step draw fresh noise. top_k and
        top_p are None when no row uses them (``unused_filters``): the sampler then skips their thresholds."""
        top_k, top_p = unused_filters(inp.top_k, inp.top_p)
        out = (host_tensor(inp.temperature, torch.float32), None if top_k else host_tensor(inp.top_k),
               None if top_p else host_tensor(inp.top_p, torch.float32), host_tensor(inp.seeds),
               host_tensor(inp.offsets))
        return [None if x is None else x.to(device, non_blocking=True) for x in out]
    def warm_kernels(self) -> int:
        """Compile every paged-attention variant each distinct KV-cache layout can pick (``warm_paged_attention``);
        returns how many ran."""
        from areno.kernels.attention.paged import warm_paged_attention

        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        heads = self.model.config.num_heads // tp
        features = self.attention_features()
        seen, runs = set(), 0
        for entry in self.kv_caches:
            if not (isinstance(entry, tuple) and len(entry) in (2, 4) and entry[0].dim() == 4):
                continue  # a recurrent layer's state pools
            key = (tuple(entry[0].shape[1:]), entry[0].dtype)
            if key not in seen:  # an FP8 cache: the dequantising variants, queries in the model's dtype
                seen.add(key)
                runs += warm_paged_attention(entry[0], entry[1], heads, features, *entry[2:], q_dtype=self.dtype)
        return runs

    def attention_features(self) -> tuple:
        """The (sliding window?, sinks dtype or None) kernel variants the model's attention layers call with (a layer
        with sinks holds them as ``sink.weight``, GPT-OSS)."""
        found = {(getattr(m, "window", None) is not None, getattr(getattr(m, "sink", None), "weight", None))
                 for m in self.model.modules() if hasattr(m, "window")}
        found = {(w, None if s is None else s.dtype) for w, s in found}
        return tuple(sorted(found, key=str)) or ((False, None),)


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

