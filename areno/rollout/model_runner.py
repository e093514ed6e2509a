"""Runs the model for one scheduled step: builds the packed inputs and attention metadata, owns the paged KV cache,
samples the next tokens, and replays CUDA graphs for pure-decode steps (one graph per batch-size bucket).

KV cache layout: one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``; layer i gets the views
``cache[i, 0]`` and ``cache[i, 1]``. Its size comes from a memory budget (a fraction of free GPU memory, or bytes)
capped by what ``max_running`` sequences of ``max_model_len`` tokens can use.
"""

from __future__ import annotations

import math

import torch

from areno.kernels import sample
from areno.models.attention_metadata import AttentionMetadata
from areno.rollout.scheduler import Step

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads_local * model.head_dim * elem


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
    return max(1, min(cap, budget // per_block))


class ModelRunner:
    def __init__(self, model, *, num_blocks, block_size, max_model_len, max_running, eager=False, device=None):
        self.model = model
        self.device = device or next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.kv_cache = torch.zeros(
            model.num_layers, 2, num_blocks, block_size, model.num_kv_heads_local, model.head_dim,
            dtype=self.dtype, device=self.device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(model.num_layers)]
        self.use_graphs = (not eager) and self.device.type == "cuda"
        self.graph_buckets = [b for b in GRAPH_BUCKETS if b <= max(1, max_running)]
        if self.graph_buckets[-1] < max_running:
            self.graph_buckets.append(max_running)
        self.graphs: dict[int, tuple] = {}
        self.graph_pool = None
        self.last_step_used_graph = False

    # ---- cache maintenance ---------------------------------------------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def release(self) -> None:
        """Drop CUDA graphs and the KV cache (``--drop-rollout-state``)."""
        self.graphs.clear()
        self.graph_pool = None
        self.kv_cache = None
        self.kv_caches = []

    # ---- inputs --------------------------------------------------------------------------------------------
    def _inputs(self, step: Step):
        bs = self.block_size
        ids, pos, slots, cu_q, seq_lens, tables = [], [], [0], [0], [], []
        slots = []
        max_q = 0
        width = max(len(c.seq.block_table) for c in step.chunks)  # eager steps: only as wide as needed
        for c in step.chunks:
            seq = c.seq
            ids.extend(seq.tokens[c.start : c.end])
            pos.extend(range(c.start, c.end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, c.end))
            cu_q.append(cu_q[-1] + c.end - c.start)
            seq_lens.append(c.end)
            tables.append(table + [0] * (width - len(table)))
            max_q = max(max_q, c.end - c.start)
        dev = self.device
        t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=dev)  # noqa: E731
        has_prefix = any(c.start > 0 for c in step.chunks)
        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            is_prefill=not step.is_decode,
            cu_seqlens_q=t(cu_q),
            cu_seqlens_k=t([0] + list(torch.tensor(seq_lens).cumsum(0).tolist())),
            max_seqlen_q=max_q,
            max_seqlen_k=max(seq_lens),
            block_table=t(tables),
            seq_lens=t(seq_lens),
            has_prefix=has_prefix,
        )
        return t(ids, torch.int64), t(pos, torch.int64), meta, cu_q

    @staticmethod
    def sampling_tensors(rows, device):
        """Per-row sampling settings; the offset (the token's position) makes each step draw fresh noise."""
        temp = torch.tensor([s.options.temperature for s in rows], dtype=torch.float32)
        top_k = torch.tensor([s.options.top_k for s in rows], dtype=torch.int64)
        top_p = torch.tensor([s.options.top_p for s in rows], dtype=torch.float32)
        seeds = torch.tensor([s.seed for s in rows], dtype=torch.int64)
        offsets = torch.tensor([len(s) for s in rows], dtype=torch.int64)
        return [x.to(device, non_blocking=True) for x in (temp, top_k, top_p, seeds, offsets)]

    def _sample(self, hidden, temp, top_k, top_p, seeds, offsets):
        logits = self.model.compute_logits(hidden)
        return sample(logits, temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds, offsets=offsets)

    # ---- run -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, step: Step, rows: list, row_index: list[int]):
        """Forward the step and sample one token for each of ``rows`` (sequences) from hidden row ``row_index``.

        Returns CPU tensors (tokens int64, logprobs fp32) and, when a row asks for them, (ids, log-probs) of the
        top candidates, else None.
        """
        want_top = max((s.options.top_logprobs for s in rows), default=0)
        if self.use_graphs and step.is_decode and not want_top and len(step.chunks) <= self.graph_buckets[-1]:
            self.last_step_used_graph = True
            return self._run_graph(step, rows)
        self.last_step_used_graph = False
        ids, pos, meta, _ = self._inputs(step)
        hidden = self.model(ids, pos, kv_caches=self.kv_caches, attn_metadata=meta)
        if not rows:  # a prefill chunk that does not reach the end of its prompt: K/V only
            return torch.empty(0, dtype=torch.int64), torch.empty(0), None
        idx = torch.tensor(row_index, dtype=torch.int64, device=self.device)
        params = self.sampling_tensors(rows, self.device)
        logits = self.model.compute_logits(hidden[idx])
        tokens, logprobs = sample(logits, temperature=params[0], top_k=params[1], top_p=params[2], seeds=params[3],
                                  offsets=params[4])
        top = None
        if want_top:  # the same tempered distribution as the returned log-probs (T = 0 counts as 1)
            temp = torch.where(params[0] > 0, params[0], torch.ones_like(params[0]))
            lp = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
            vals, ids = lp.topk(want_top, dim=-1)
            top = (ids.cpu(), vals.cpu())
        return tokens.cpu(), logprobs.float().cpu(), top

    # ---- CUDA graphs for decode ----------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        return next(b for b in self.graph_buckets if b >= n)

    def _capture(self, bsz: int):
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
        meta = AttentionMetadata(
            slot_mapping=buf["slots"], is_prefill=False, cu_seqlens_q=buf["cu"], cu_seqlens_k=None,
            max_seqlen_q=1, max_seqlen_k=mb * self.block_size, block_table=buf["table"], seq_lens=buf["lens"],
            has_prefix=False,
        )

        def body():
            hidden = self.model(buf["ids"], buf["pos"], kv_caches=self.kv_caches, attn_metadata=meta)
            return self._sample(hidden, buf["temp"], buf["top_k"], buf["top_p"], buf["seeds"], buf["offsets"])

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up (Triton autotune, allocator) outside the graph
                body()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = body()
        if self.graph_pool is None:
            self.graph_pool = graph.pool()
        self.graphs[bsz] = (graph, buf, out)

    def _run_graph(self, step: Step, rows):
        n = len(step.chunks)
        bsz = self._bucket(n)
        if bsz not in self.graphs:
            self._capture(bsz)
        graph, buf, (tokens, logprobs) = self.graphs[bsz]
        bs = self.block_size
        ids = [c.seq.tokens[-1] for c in step.chunks]
        pos = [len(c.seq) - 1 for c in step.chunks]
        slots = [c.seq.block_table[p // bs] * bs + p % bs for c, p in zip(step.chunks, pos)]
        table = torch.zeros(bsz, self.max_blocks_per_seq, dtype=torch.int32)
        for i, c in enumerate(step.chunks):
            table[i, : len(c.seq.block_table)] = torch.tensor(c.seq.block_table, dtype=torch.int32)
        pad = bsz - n
        buf["ids"].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        buf["pos"].copy_(torch.tensor(pos + [0] * pad), non_blocking=True)
        buf["slots"].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        buf["table"].copy_(table, non_blocking=True)
        buf["lens"].copy_(torch.tensor([p + 1 for p in pos] + [1] * pad, dtype=torch.int32), non_blocking=True)
        temp, top_k, top_p, seeds, offsets = self.sampling_tensors(rows, "cpu")
        for name, val, fill in (("temp", temp, 1.0), ("top_k", top_k, 0), ("top_p", top_p, 1.0),
                                ("seeds", seeds, 0), ("offsets", offsets, 0)):
            buf[name][:n].copy_(val, non_blocking=True)
            buf[name][n:].fill_(fill)
        graph.replay()
        return tokens[:n].cpu(), logprobs[:n].float().cpu(), None
