"""The steady speculative step's target verify forward, eager or replayed from a CUDA graph (``spec_exec``), and at
width 1 the forward of a gated step of decodes (the gate made it plain: no draft), replayed the same way.

A steady step: every row decodes and verifies a full draft of K tokens (no prefill chunk, no fresh fork, no shorter
draft, not gated). Its forward runs in decode mode over B x (K + 1) rows (``AttentionMetadata.tokens_per_seq`` =
K + 1: each row a query token over its ``seq_lens`` keys, the step's K/V all stored first, so causal within the step;
the hybrids' recurrent layers step through each sequence's K + 1 rows in order, as K + 1 decode steps do), then the
logits of every row. Without graphs it runs on the step's own tensors; with graphs a graph per (batch-size bucket, K)
replays it on static buffers (``verify_buffers``), padding rows at slot -1 and state slot -1 writing nothing, as the
plain decode graphs do (``decode_graphs``), captured into the runner's graph pool at server start
(``Engine.capture_graphs``: every bucket a steady step replays) or on first use. Both call the same body
(``verify_body``), so a replay gives the eager step's hidden rows and logits.

The hybrids' rollback needs no second forward here (``StateSteps``, written inside the graph): the delta-rule layers
write no state in a verify but keep its tokens' inputs (``kernels.linear_attn.steps.VerifyInputs``), and
``VerifyGraphs.roll_back`` replays each row's accepted tokens on its state (one read and one write of it; a graph a
bucket after a replayed verify); the short convs (a small state) step in place and keep their states after each of
the first K tokens, a rejecting row's slot taking the one after its last accepted input (one row copy, in the same
replay body: ``replay_body``). The K/V and hidden rows of accepted positions are already right.
After the forward, on static shapes too: the rejection sampling (``spec_sample``, the leader's, read back once) and,
once the leader appended and decided, the MTP catch-up and chain (``spec_chain``, drafts kept on the device for the
next verify, which writes their tokens into its ids: ``StepInputs.draft_ids``). Eager: the
host's planning. The verify's graphs keep their logits ``[bucket x (K + 1), V]`` fp32,
and a bucket is replayed while bucket x (K + 1) rows stay within ``VERIFY_GRAPH_ROWS`` or the largest decode bucket,
whichever is more (larger steady steps run the same bodies eagerly: their logits and the sampling's temporaries,
several times rows x V x 4 bytes, are then not held in the graph pool). Memory: the stash (K x rows x one slot's
conv states, rows x (K + 1) tokens' delta-rule inputs) is sized once with the runner, rows the largest speculating
batch rounded up to its bucket (``stash_rows``), and its bytes come out of the KV-cache budget (``stash_bytes``,
``spec_decode.spec_budget``); a step never grows it. The sampling replay is read back through a pinned buffer
(``read_back``).
"""

from __future__ import annotations

import numpy as np
import torch

from areno.engine.scheduler import Chunk, Step
from areno.engine.step_inputs import StepInputs, host_tensor, pad_tables
from areno.kernels.linear_attn.steps import VerifyInputs
from areno.kernels.state_copy import copy_rows
from areno.models.attention_metadata import AttentionMetadata

# Token rows a verify graph may hold whatever the decode buckets (64 rows x K = 2 at --max-running-prompts 64: eager,
# hence host-bound, while 1..8 rows were replayed; 512 rows of the 152k vocabulary keep ~0.3 GB of fp32 logits).
VERIFY_GRAPH_ROWS = 512


def verify_meta(r, buf: dict, width: int) -> AttentionMetadata:
    """The decode-mode metadata of a verify over ``buf`` (static graph buffers or the step's own tensors)."""
    meta = AttentionMetadata(
        slot_mapping=buf["slots"], is_prefill=False, cu_seqlens_q=buf["cu"], max_seqlen_q=1,
        max_seqlen_k=buf["table"].shape[1] * r.block_size, block_table=buf["table"], seq_lens=buf["lens"],
        state_indices=buf.get("state_idx"), routing_out=buf.get("routing"), tokens_per_seq=width,
    )  # fmt: skip
    if "gslots" in buf:  # KV-cache groups 1.. (sliding-window layers)
        meta.layer_groups, meta.group_slot_mappings = r.layer_groups, list(buf["gslots"])
        meta.group_block_tables = list(buf["gtables"])
    return meta


class StateSteps:
    """What a hybrid's verify keeps for its rollback: ``conv [L, K, rows, ...]``, the short convs' states after each
    of its first K tokens (the pool's layout, ``state_cache``), and ``recurrent``, one ``VerifyInputs`` a delta-rule
    layer (its tokens' inputs, for the replay); each recurrent layer takes its own with ``next(kind)``, in layer
    order."""

    def __init__(self, conv: torch.Tensor, recurrent: list[VerifyInputs]):
        self.bufs, self.used = {"conv": conv, "recurrent": recurrent}, {"conv": 0, "recurrent": 0}

    def next(self, kind: str) -> torch.Tensor:
        j = self.used[kind]
        self.used[kind] = j + 1
        return self.bufs[kind][j]


def verify_body(r, buf: dict, width: int, stash: tuple | None = None):
    """The verify forward and the logits of every row: (hidden [R, H], logits [R, V]); no host sync. ``stash``: the
    hybrids' (conv, recurrent) buffers the states after each token go to. ``width`` 1 (a gated step of decodes):
    the forward only, logits None (the runner's sampling takes them from the hidden rows)."""
    meta = verify_meta(r, buf, width)
    meta.state_steps = None if stash is None else StateSteps(*stash)
    hidden = r.model(buf["ids"], buf["pos"], kv_caches=r.kv_caches, attn_metadata=meta)
    return hidden, (r.logits(hidden) if width > 1 else None)


def replay_body(r, stash: tuple, buf: dict) -> tuple:
    """Every delta-rule layer's replay of the verify's kept inputs: the first ``buf["counts"][b]`` tokens of row b on
    state slot ``buf["slots"][b]`` (-1 / 0: a padding row, untouched); then the conv states of the rows that rejected
    a draft (counts[b] - 1 < K accepted) from the stash's entry after their last accepted input (one row copy each,
    the others skipped). No host sync."""
    slots, counts = buf["slots"], buf["counts"]
    for layer, inputs in enumerate(stash[1]):
        inputs.replay(r.states.recurrent[layer], slots, counts)
    conv = stash[0]  # [L, K, rows, ...]: the states after each of a verify's first K tokens
    k, accepted = conv.shape[1], counts.long() - 1
    rejected = torch.where((accepted < k) & (slots >= 0), slots, -1)
    src = accepted.clamp(0, k - 1) * conv.shape[2] + torch.arange(slots.shape[0], device=slots.device)
    copy_rows(r.states.conv, rejected, conv.flatten(1, 2), src)
    return ()


def capture_replay(r, stash: tuple, bsz: int) -> tuple:
    """Capture ``replay_body`` for a verify bucket of ``bsz`` rows (after that bucket's verify kept its inputs; the
    warm-ups' slots are all -1, so they write nothing): (graph, static buffers, ())."""
    buf = {"slots": torch.full((bsz,), -1, dtype=torch.int32, device=r.device),
           "counts": torch.zeros(bsz, dtype=torch.int32, device=r.device)}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            replay_body(r, stash, buf)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=r.graph_pool):
        replay_body(r, stash, buf)
    return graph, buf, ()


def verify_inputs(r, seqs: list, width: int, row_index: list[int], copies) -> StepInputs:
    """A steady step's inputs: each sequence's ``width`` rows at positions len - 1 .. len - 2 + width (their blocks
    reserved), sampling settings and state slot per sequence, ``offsets`` each length (the ids are the caller's).
    Built per sequence (one ``Chunk`` a row through ``ModelRunner.prepare``, the path of sliding-window groups, cost
    ~3 us a row on the host)."""
    if r.layer_groups is not None or r.lora is not None or r.images is not None:
        flat = [Chunk(s, len(s) - 1 + j, len(s) + j) for s in seqs for j in range(width)]
        inp = r.prepare(Step(flat, is_decode=True), seqs, row_index, copies)
        inp.offsets = [len(s) for s in seqs]
        if inp.state_slots is not None:
            inp.state_slots = [s.state_slot for s in seqs]
        return inp
    bs, lens, tables = r.block_size, [len(s) for s in seqs], [s.block_table for s in seqs]
    pos = [n - 1 + j for n in lens for j in range(width)]
    slots = [tb[p // bs] * bs + p % bs for tb, n in zip(tables, lens) for p in range(n - 1, n - 1 + width)]
    opts = [s.options for s in seqs]
    return StepInputs(
        ids=[], positions=pos, slots=slots, cu_q=list(range(len(pos) + 1)), seq_lens=[p + 1 for p in pos],
        tables=[tb for tb in tables for _ in range(width)], is_decode=True,
        row_index=list(row_index), temperature=[o.temperature for o in opts], top_k=[o.top_k for o in opts],
        top_p=[o.top_p for o in opts], seeds=[s.seed for s in seqs], offsets=lens,
        top_logprobs=max((o.top_logprobs for o in opts), default=0), copies=list(copies),
        state_slots=[s.state_slot for s in seqs] if r.states is not None else None,
    )  # fmt: skip


def verify_host(r, inp: StepInputs, rows: int, seqs: int, table_width: int, width: int = 1) -> dict:
    """The verify's inputs on the host, padded to ``rows`` token rows and ``seqs`` sequences (padding rows at slot
    -1, state slot -1), the block tables ``table_width`` blocks wide (``width``: token rows a sequence, each
    sequence's ``width`` rows one table)."""
    pad = rows - len(inp.ids)
    table = pad_tables(inp.tables[::width], rows, table_width, width)
    host = {"ids": host_tensor(inp.ids + [0] * pad), "pos": host_tensor(inp.positions + [0] * pad),
            "slots": host_tensor(inp.slots + [-1] * pad), "table": torch.from_numpy(table),
            "lens": host_tensor(inp.seq_lens + [1] * pad, torch.int32)}
    if inp.group_tables is not None:
        gtables = np.stack([pad_tables(tables[::width], rows, table_width, width) for tables in inp.group_tables])
        host["gtables"] = torch.from_numpy(gtables)
        host["gslots"] = host_tensor([x + [-1] * pad for x in inp.group_slots])
    if inp.state_slots is not None:
        host["state_idx"] = host_tensor(inp.state_slots + [-1] * (seqs - len(inp.state_slots)), torch.int32)
    return host


def verify_buffers(r, bsz: int, width: int) -> dict:
    """The static inputs of the verify graph of ``bsz`` sequences x ``width`` rows (routes recorded when the runner
    records them)."""
    dev, rows = r.device, bsz * width
    buf = {name: val.to(dev) for name, val in verify_host(r, _empty(r), rows, bsz, r.max_blocks_per_seq).items()}
    buf["cu"] = torch.arange(rows + 1, dtype=torch.int32, device=dev)
    if r.record_routing:
        buf["routing"] = torch.zeros(r.model.num_moe_layers, rows, r.model.moe_top_k, dtype=torch.int32, device=dev)
    return buf


def _empty(r) -> StepInputs:
    groups = None if r.layer_groups is None else [[] for _ in range(len(r.group_windows) - 1)]
    return StepInputs([], [], [], [0], [], [], True, [], [], [], [], [], [], 0, [], group_tables=groups,
                      group_slots=groups, state_slots=[] if r.states is not None else None)


def stash_rows(limit: int | None, max_running: int, use_graphs: bool, buckets: list[int], width: int) -> int:
    """Rows of the stash: the most a steady step verifies, its largest speculating batch N = min(max_running, the
    gate's limit) rounded up to its graph bucket when that bucket is replayed (``VerifyGraphs.graphable``)."""
    n = max_running if limit is None else max(1, min(limit, max_running))
    if use_graphs and _graphable(buckets, n, width):
        return next(b for b in buckets if b >= n)
    return n


def stash_bytes(model, rows: int, k: int, dtype: torch.dtype) -> int:
    """Device bytes of the stash of a hybrid ``model`` (0 for attention-only ones): K x rows x one slot's conv states
    (``dtype``) and rows x (K + 1) tokens' delta-rule inputs a layer, bounded by the conv's channels in ``dtype``
    and fp32 gates and betas (Qwen3.5's q/k/v rows and a, b; KDA's k, v, per-channel g and beta); no delta-rule
    state (the verify keeps none), whatever the pool's dtype."""
    shapes = model.recurrent_state_shapes()
    if not shapes:
        return 0
    (c, w), (h, kd, _) = shapes["conv"], shapes["recurrent"]
    token = dtype.itemsize * c + 4 * h * (kd + 2)
    return len(shapes["layers"]) * rows * (k * dtype.itemsize * c * w + (k + 1) * token)


def _graphable(buckets: list[int], n: int, width: int) -> bool:
    return n <= buckets[-1] and next(b for b in buckets if b >= n) * width <= max(buckets[-1], VERIFY_GRAPH_ROWS)


def read_back(r, buf: dict, out: torch.Tensor) -> torch.Tensor:
    """A replay's output on the host: copied into a pinned buffer kept in ``buf`` (one per graph: read before the
    next replay), then the stream synchronised (the caller reads it at once)."""
    host = buf.get("read_back")
    if host is None:
        host = buf["read_back"] = torch.empty(out.shape, dtype=out.dtype, pin_memory=r.device.type == "cuda")
    host.copy_(out, non_blocking=True)
    if r.device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    return host


class VerifyGraphs:
    """One runner's verify graphs, keyed ("verify", bucket, K + 1) in the runner's ``graphs`` (dropped with them),
    and the hybrids' stash they write (``StateSteps``): sized once for ``rows``, the most a steady step verifies
    (``stash_rows``; the engine takes its bytes out of the KV-cache budget, ``stash_bytes``), never grown."""

    def __init__(self, r, rows: int, width: int):
        self.rows, self.stash = rows, None
        if r.states is not None:
            conv = r.states.conv
            self.stash = (torch.empty(conv.shape[0], width - 1, rows, *conv.shape[2:], dtype=conv.dtype,
                                      device=conv.device),
                          [VerifyInputs(rows * width) for _ in range(r.states.recurrent.shape[0])])
        self.bucket = None
        self.vbuf, self.width = None, 1  # the last verify's inputs (a graph's static buffers, or the step's own)

    def _stash(self, rows: int, width: int) -> tuple | None:
        if width == 1:  # a gated step of decodes: no draft, no state after each token to keep
            return None
        if self.stash is not None and (self.stash[0].shape[1] != width - 1 or rows > self.rows):
            raise RuntimeError(f"a steady step of {rows} sequences x {width} rows past the stash sized at start "
                               f"({self.rows} x {self.stash[0].shape[1] + 1})")
        return self.stash

    def roll_back(self, r, slots: list[int], accepted: list[int]) -> None:
        """A hybrid's commit after a steady step of rows with state ``slots`` (in the verify's row order) and
        ``accepted`` drafts each: every delta-rule layer replays each row's accepted inputs (accepted + 1 tokens) on
        its state, which the verify left as it was (one launch a layer, or one graph replay a bucket, keyed
        ("replay", bucket), after a replayed verify), and a rejecting row's conv states take those after its last
        accepted input in the same body (``replay_body``). The K/V are already the right ones."""
        counts = [a + 1 for a in accepted]
        if self.bucket is None:
            replay_body(r, self.stash, {"slots": host_tensor(slots, torch.int32).to(r.device),
                                        "counts": host_tensor(counts, torch.int32).to(r.device)})
        else:
            key, pad = ("replay", self.bucket), self.bucket - len(slots)
            if key not in r.graphs:
                r.graphs[key] = capture_replay(r, self.stash, self.bucket)
            graph, buf, _ = r.graphs[key]
            buf["slots"].copy_(host_tensor(slots + [-1] * pad, torch.int32), non_blocking=True)
            buf["counts"].copy_(host_tensor(counts + [0] * pad, torch.int32), non_blocking=True)
            graph.replay()

    def run(self, r, inp: StepInputs, width: int, routes: bool):
        """The verify of ``inp`` (B x ``width`` rows): (hidden, logits, metadata, positions), each covering at least
        the step's rows in order (a replay's: its bucket's, padding rows after them). ``routes``: keep the routes
        (eager: only then recorded). ``self.bucket``: the replayed graph's bucket (None: eager)."""
        self.bucket = None
        n = len(inp.ids) // width
        if not self.graphable(r, n, width):
            buf = self.vbuf = self._eager_buffers(r, inp, width, routes)
            if inp.draft_ids is not None:  # the drafts' tokens, on the device (spec_sample.draft_ids)
                buf["ids"].view(n, width)[:, 1:].copy_(inp.draft_ids)
            self.width = width
            hidden, logits = verify_body(r, buf, width, self._stash(n, width))
            return hidden, logits, verify_meta(r, buf, width), buf["pos"]
        bsz = r._bucket(n)
        key, stash = ("verify", bsz, width), self._stash(bsz, width)
        if key not in r.graphs:
            r.graphs[key] = self.capture(r, bsz, width, stash)
        graph, buf, (hidden, logits) = r.graphs[key]
        for name, val in verify_host(r, inp, bsz * width, bsz, r.max_blocks_per_seq, width).items():
            buf[name].copy_(val, non_blocking=True)
        if inp.draft_ids is not None:
            buf["ids"].view(bsz, width)[:n, 1:].copy_(inp.draft_ids)
        graph.replay()
        self.bucket, self.vbuf, self.width = bsz, buf, width
        meta = verify_meta(r, buf, width)
        meta.routing_out = buf["routing"] if routes else None
        return hidden, logits, meta, buf["pos"]

    @staticmethod
    def graphable(r, n: int, width: int) -> bool:
        """Replayed when the runner uses graphs and the bucket's rows stay within the largest decode bucket or
        ``VERIFY_GRAPH_ROWS``."""
        return r.use_graphs and _graphable(r.graph_buckets, n, width)

    def capture_buckets(self, r, width: int) -> list[int]:
        """The buckets steady steps replay (all within the stash's rows, ``stash_rows``): ``Engine.capture_graphs``."""
        return [b for b in r.graph_buckets if b <= self.rows and self.graphable(r, b, width)]

    @staticmethod
    def _eager_buffers(r, inp: StepInputs, width: int, routes: bool) -> dict:
        rows = len(inp.ids)
        width_blocks = max(len(tb) for tables in [inp.tables, *(inp.group_tables or [])] for tb in tables)
        host = verify_host(r, inp, rows, rows // width, width_blocks, width)
        buf = {name: val.to(r.device) for name, val in host.items()}
        buf["cu"] = torch.arange(rows + 1, dtype=torch.int32, device=r.device)
        if routes:
            buf["routing"] = torch.empty(r.model.num_moe_layers, rows, r.model.moe_top_k, dtype=torch.int32,
                                         device=r.device)  # fmt: skip
        return buf

    @staticmethod
    def capture(r, bsz: int, width: int, stash: tuple | None) -> tuple:
        """Capture the verify graph of ``bsz`` sequences (two warm-ups on a side stream first, as ``_capture``):
        (graph, static buffers, (hidden, logits))."""
        buf = verify_buffers(r, bsz, width)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                verify_body(r, buf, width, stash)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=r.graph_pool):
            out = verify_body(r, buf, width, stash)
        if r.graph_pool is None:
            r.graph_pool = graph.pool()
        return graph, buf, out
