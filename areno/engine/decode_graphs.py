"""CUDA graphs for decode, a mixin of ``ModelRunner``: one graph per (batch-size bucket, chained steps, logit-adjustment
width[, per-row position offsets]), captured on first use or up front (``capture_graphs``), replayed with their
tokens copied to pinned host buffers behind an event (``DecodeLaunch``); the same device loop (``decode_steps``)
runs k chained steps eagerly without graphs. See ``model_runner`` for multi-step decode and the adjustments.
"""

from __future__ import annotations

import numpy as np
import torch

from areno.engine.logit_adjust import adjust_host
from areno.engine.step_inputs import DecodeLaunch, LogitAdjust, StepInputs, host_tensor, pad_tables, unused_filters
from areno.kernels.sampler import sample
from areno.models.attention_metadata import AttentionMetadata

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
SPARSE_MIN_WIDTH = 16  # the graphs' per-row logit-bias/ban list: a power of two, at least this wide


def graph_plan(max_running: int, eager: bool, device: torch.device) -> tuple[bool, list[int]]:
    """(whether a runner replays CUDA graphs, its batch-size buckets): the buckets up to ``max_running``, which is
    the last one (known before the runner exists: the speculative stash is sized from them, ``spec_graphs``)."""
    buckets = [b for b in GRAPH_BUCKETS if b <= max(1, max_running)]
    if buckets[-1] < max_running:
        buckets.append(max_running)
    return (not eager) and device.type == "cuda", buckets


def graph_key(bsz: int, k: int, width: int, rope_off: bool, hidden: bool = False) -> tuple:
    """A graph's key: (rows, chained steps, logit-adjustment width), plus a mark for per-row position offsets
    (graphs without offsets, all of a text-only model's, do no extra work) and one for graphs that keep each step's
    hidden rows (speculation's gated chains, ``keep_hidden``)."""
    return (bsz, k, width) + (("rope_off",) if rope_off else ()) + (("hidden",) if hidden else ())


class DecodeGraphs:
    """The decode-graph half of ``ModelRunner`` (it reads the runner's model, caches, buffers and adjuster)."""

    def _bucket(self, n: int) -> int:
        return next(b for b in self.graph_buckets if b >= n)

    def decode_steps(self, buf: dict, k: int):
        """``k`` chained decode steps from the inputs in ``buf`` (device tensors, see ``_capture``); no host sync.
        Rows whose slot is -1 (graph padding) stay put and write nothing. Returns tokens/logprobs ``[k, rows]``.
        ``buf["rope_off"]`` (prompts with images): the model's position is the cache position plus the row's offset.
        ``buf["hidden"]`` ``[k, rows, H]``: each step's final hidden rows are kept there (speculation's gated chains:
        the MTP catch-up of those positions runs later from them)."""
        ids, pos, slots, lens, offsets = buf["ids"], buf["pos"], buf["slots"], buf["lens"], buf["offsets"]
        table, bs = buf["table"], self.block_size
        if self.record_routing and "routing" not in buf:  # made on the first (warm-up) call: static in the graph
            buf["routing"] = torch.empty(k, self.model.num_moe_layers, ids.shape[0], self.model.moe_top_k,
                                         dtype=torch.int32, device=ids.device)
        live = (slots >= 0).long()
        gslots = list(buf["gslots"]) if "gslots" in buf else None  # KV-cache groups 1.. (sliding-window layers)
        adjust, min_left = "sp_ids" in buf, buf.get("min_left")
        tokens, logprobs = [], []
        if self.lora is not None:  # LoRA serving: each row's adapter slot (a static graph input; padding rows -1)
            self.lora.index = buf["lora"]
        for i in range(k):
            if i:  # the next position of every live row, its slot from the (reserved) block table
                ids, pos, offsets, lens = tokens[-1], pos + live, offsets + live, lens + live.int()
                min_left = min_left - live.int() if adjust else None
                block = table.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long()
                slots = torch.where(live.bool(), block * bs + pos % bs, torch.full_like(slots, -1))
                if gslots is not None:
                    blocks = [tb.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long() for tb in buf["gtables"]]
                    gslots = [torch.where(live.bool(), b * bs + pos % bs, slots) for b in blocks]
            meta = AttentionMetadata(
                slot_mapping=slots, is_prefill=False, cu_seqlens_q=buf["cu"], cu_seqlens_k=None, max_seqlen_q=1,
                max_seqlen_k=table.shape[1] * bs, block_table=table, seq_lens=lens, has_prefix=False,
                state_indices=buf.get("state_idx"), routing_out=buf["routing"][i] if "routing" in buf else None,
            )
            if gslots is not None:
                meta.layer_groups, meta.group_slot_mappings = self.layer_groups, gslots
                meta.group_block_tables = list(buf["gtables"])
            rope = pos + buf["rope_off"] if "rope_off" in buf else pos
            hidden = self.model(ids, rope, kv_caches=self.kv_caches, attn_metadata=meta)
            if "hidden" in buf:
                buf["hidden"][i].copy_(hidden)
            logits = self.logits(hidden)
            if adjust:
                self.adjuster.apply(logits, buf, min_left)
            tok, lp = sample(logits, temperature=buf["temp"], top_k=buf["top_k"], top_p=buf["top_p"],
                             seeds=buf["seeds"], offsets=offsets, min_p=buf["min_p"] if adjust else None)
            if adjust:
                self.adjuster.record(buf, tok)
            tokens.append(tok)
            logprobs.append(lp)
        if self.lora is not None:
            self.lora.index = None
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
        if self.layer_groups is not None:  # the other KV-cache groups' tables and first slots
            groups = len(self.group_windows) - 1
            buf["gtables"] = torch.zeros(groups, bsz, mb, dtype=torch.int32, device=dev)
            buf["gslots"] = torch.full((groups, bsz), -1, dtype=torch.int64, device=dev)
        if self.states is not None:
            buf["state_idx"] = torch.full((bsz,), -1, dtype=torch.int32, device=dev)
        if self.lora is not None:
            buf["lora"] = torch.full((bsz,), -1, dtype=torch.int32, device=dev)
        if width:  # logit adjustments: neutral values until a step copies its own in
            self.adjuster.counts()
            buf.update({name: val.to(dev) for name, val in adjust_host(
                LogitAdjust([], [], [], [], [], [], [], []), bsz, width, penalties=True).items()})
        return buf

    def _capture(self, bsz: int, k: int, width: int = 0, rope_off: bool = False, hidden: bool = False):
        buf = self._graph_buffers(bsz, width, rope_off)
        if hidden:
            buf["hidden"] = self._hidden_rows(k, bsz)
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
        self.graphs[graph_key(bsz, k, width, rope_off, hidden)] = (graph, buf, out)

    def _hidden_rows(self, k: int, rows: int) -> torch.Tensor:
        return torch.empty(k, rows, self.model.config.hidden_size, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def capture_graphs(self, decode_steps=(1,)) -> int:
        """Capture the plain decode graph of every batch-size bucket for each k in ``decode_steps`` now (a server
        does this at start: a graph captured on first use stalls that step by the capture's time). Returns how many
        were captured; none without graphs."""
        if not self.use_graphs:
            return 0
        todo = [(b, k) for k in decode_steps for b in self.graph_buckets
                if graph_key(b, k, 0, False) not in self.graphs]
        for bsz, k in todo:
            self._capture(bsz, k)
        return len(todo)

    def _run_graph(self, inp: StepInputs):
        tokens, logprobs = self.wait_decode(self._launch_graph(inp, None))
        return (tokens, logprobs) if inp.decode_steps > 1 else (tokens[0], logprobs[0], None)

    def _launch_graph(self, inp: StepInputs, ids_from: tuple | None) -> DecodeLaunch:
        """Replay the bucket's graph on ``inp`` and queue the copies of its tokens to pinned host buffers."""
        n, k = len(inp.seq_lens), inp.decode_steps
        bsz = self._bucket(n)
        width = 0 if inp.adjust is None else max(SPARSE_MIN_WIDTH, 1 << (inp.adjust.width - 1).bit_length())
        rope_off, hidden = inp.rope_offsets is not None, self.keep_hidden
        key = graph_key(bsz, k, width, rope_off, hidden)
        if key not in self.graphs:
            kw = {"rope_off": True} if rope_off else {}
            self._capture(bsz, k, width, **kw, **({"hidden": True} if hidden else {}))
        graph, buf, (tokens, logprobs) = self.graphs[key]
        self.last_hidden = buf.get("hidden")
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
        host = self._graph_host(inp, n, width=max(len(tb) for tables in [inp.tables, *(inp.group_tables or [])]
                                                  for tb in tables))
        buf = {name: val.to(self.device) for name, val in host.items()}
        buf["cu"] = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        for name, unused in zip(("top_k", "top_p"), unused_filters(inp.top_k, inp.top_p)):
            if unused:  # no row filters: the sampler skips the threshold (graphs keep their static buffers)
                buf[name] = None
        if ids_from is not None:
            buf["ids"] = self._ids_from(ids_from)
        if self.keep_hidden:
            buf["hidden"] = self._hidden_rows(inp.decode_steps, n)
        self.last_hidden = buf.get("hidden")
        tokens, logprobs = self.decode_steps(buf, inp.decode_steps)
        self.last_routing = buf["routing"].cpu() if self.record_routing else None
        return DecodeLaunch(inp.decode_steps, n, tokens, (tokens.cpu(), logprobs.float().cpu()))

    def _graph_host(self, inp: StepInputs, bsz: int, width: int | None = None, sparse_width: int | None = None):
        """The graph's inputs on the host, padded to the bucket (padding rows write nowhere and read one slot);
        the block table ``width`` blocks wide (default: the graphs' full width); with logit adjustments, their
        sparse lists ``sparse_width`` wide and every entry a graph has (default: as wide and as many as needed)."""
        pad = bsz - len(inp.seq_lens)
        table = pad_tables(inp.tables, bsz, width or self.max_blocks_per_seq)
        host = {
            "ids": host_tensor(inp.ids + [0] * pad), "pos": host_tensor(inp.positions + [0] * pad),
            "slots": host_tensor(inp.slots + [-1] * pad), "table": torch.from_numpy(table),
            "lens": host_tensor(inp.seq_lens + [1] * pad, torch.int32),
            "temp": host_tensor(inp.temperature + [1.0] * pad, torch.float32),
            "top_k": host_tensor(inp.top_k + [0] * pad), "top_p": host_tensor(inp.top_p + [1.0] * pad, torch.float32),
            "seeds": host_tensor(inp.seeds + [0] * pad), "offsets": host_tensor(inp.offsets + [0] * pad),
        }
        if inp.group_tables is not None:
            gtables = np.stack([pad_tables(tables, bsz, table.shape[1]) for tables in inp.group_tables])
            host["gtables"] = torch.from_numpy(gtables)
            host["gslots"] = host_tensor([x + [-1] * pad for x in inp.group_slots])
        if inp.rope_offsets is not None:
            host["rope_off"] = host_tensor(inp.rope_offsets + [0] * pad)
        if inp.state_slots is not None:
            host["state_idx"] = host_tensor(inp.state_slots + [-1] * pad, torch.int32)
        if self.lora is not None:
            host["lora"] = host_tensor((inp.lora or [-1] * len(inp.seq_lens)) + [-1] * pad, torch.int32)
        if inp.adjust is not None:
            graph = sparse_width is not None
            host.update(adjust_host(inp.adjust, bsz, sparse_width if graph else inp.adjust.width,
                                          penalties=True if graph else None))
        return host
