"""A steady speculative step's MTP catch-up and draft chain (``spec_exec``), eager or replayed from a CUDA graph
right after the verify's (``spec_graphs``), on static shapes.

After the verify the leader knows every row's outcome, so the whole draft work has host-known inputs: the next token
at each verified position (``nxt``), each drafting row's hidden row (``pick``: its last accepted position), draft
length K_b, block table (grown for the draft), length and sampling settings. The body runs MTP step 0 over all B x
(K + 1) rows of the verify (writing the draft's K/V at the verify's slots), then for j = 1 .. K - 1 an MTP decode step
of every chain row at position len - 2 + j, the rows with K_b <= j (and padding rows) at slot -1 writing nothing
and read by no one; each step's tokens are drawn on the leader (the draft's Philox stream, as ``SpecExec._draw``)
and broadcast to the TP followers in the body. Outputs: tokens ``[K, rows]`` and the draft distributions ``[K, rows,
V]``, both copied out of the graph's buffers and kept on the device for the next verify (``spec_sample.Draft``; the
tokens read to the host only under TP, whose verify ids are broadcast as lists). A graph per (batch bucket, K + 1,
filters used) reads the verify graph's static hidden rows and metadata (captured on first use, or at server start
without filters: ``capture_plain``); eagerly the same body runs on the step's own tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areno.engine.spec_graphs import verify_meta
from areno.engine.step_inputs import host_tensor, pad_tables
from areno.kernels.draft_draw import draw_from_probs
from areno.kernels.sampler import sampling_probs
from areno.models.attention_metadata import AttentionMetadata

DRAFT_STREAM = 3 << 40  # Philox offset added for the draft tokens' noise (above verify_draft's streams)


def chain_host(c, nxt: list[int], rows: int, bsz: int, k: int, mb: int, leader: bool) -> dict:
    """The chain's inputs on the host: ``nxt`` padded to ``rows`` verify rows, the chain's own padded to ``bsz``
    (padding rows: K_b = 0, never live), block tables ``mb`` wide; the sampling settings on the leader only."""
    pad = bsz - len(c.pick)
    table = torch.from_numpy(pad_tables(c.tables, bsz, mb))
    host = {"nxt": host_tensor(nxt + [0] * (rows - len(nxt))), "pick": host_tensor(c.pick + [0] * pad),
            "kb": host_tensor(c.kbs + [0] * pad), "base": host_tensor([x - 2 for x in c.lengths] + [0] * pad),
            "table": table}
    if leader:
        host.update(temp=host_tensor(c.temperature + [1.0] * pad, torch.float32),
                    seeds=host_tensor(c.seeds + [0] * pad), lengths=host_tensor(c.lengths + [0] * pad))
        if any(c.top_k):
            host["top_k"] = host_tensor(c.top_k + [0] * pad)
        if any(p < 1.0 for p in c.top_p):
            host["top_p"] = host_tensor(c.top_p + [1.0] * pad, torch.float32)
    return host


def chain_body(r, ex, vbuf: dict, hidden, buf: dict, width: int, k: int):
    """Catch-up and chain on ``buf`` (see the module docstring); no host sync. Returns (tokens [K, rows] int64,
    probs [K, rows, V] or None on a follower)."""
    meta = verify_meta(r, vbuf, width)
    meta.routing_out = None  # the draft's MoE block must not write the target's routes
    out, g = ex.draft(r.model, 0, hidden, buf["nxt"], vbuf["pos"], meta, ex.mtp_kv)
    o, g = out.index_select(0, buf["pick"]), g.index_select(0, buf["pick"])
    table, bs = buf["table"], r.block_size
    cu = torch.arange(table.shape[0] + 1, dtype=torch.int32, device=table.device)
    toks, probs, t = [], [], None
    for j in range(k):
        if j:
            live = buf["kb"] > j
            pos = buf["base"] + j
            block = table.gather(1, (pos // bs).clamp(max=table.shape[1] - 1)[:, None])[:, 0].long()
            m = AttentionMetadata(slot_mapping=torch.where(live, block * bs + pos % bs, -1), is_prefill=False,
                                  cu_seqlens_q=cu, max_seqlen_q=1, max_seqlen_k=table.shape[1] * bs,
                                  block_table=table, seq_lens=torch.where(live, pos + 1, 1).int())  # fmt: skip
            o, g = ex.draft(r.model, 0, g, t, pos, m, ex.mtp_kv)
        logits = r.logits(o, ex.draft.head_weight(r.model, j))
        if ex.leader:
            q = sampling_probs(logits, temperature=buf["temp"], top_k=buf.get("top_k"), top_p=buf.get("top_p"))
            t = draw_from_probs(q, buf["seeds"], buf["lengths"] + j + DRAFT_STREAM)
            probs.append(q)
        else:
            t = torch.empty(o.shape[0], dtype=torch.int64, device=o.device)
        if ex.group is not None and j + 1 < k:
            dist.broadcast(t, src=dist.get_global_rank(ex.group, 0), group=ex.group)
        toks.append(t)
    return torch.stack(toks), (torch.stack(probs) if probs else None)


def run_chain(r, ex, c, nxt: list[int]) -> list | None:
    """The steady step's catch-up and chain; on the leader the drafts [(tokens, K_b, probs [n, K, V], row, ids [n,
    K])] per chain row (their distributions and tokens one device tensor each, each row's its row of them; the host
    ``tokens`` None without TP: nothing is read back, the next verify takes them on the device), else None."""
    vg = ex.graphs
    hidden, width = ex.last[0], vg.width
    k, n, mb = width - 1, len(c.pick), r.max_blocks_per_seq
    if vg.bucket is None:  # eager: the step's own rows, tables as wide as they are
        mb = max(len(tb) for tb in c.tables)
        buf = {name: v.to(r.device) for name, v in chain_host(c, nxt, hidden.shape[0], n, k, mb, ex.leader).items()}
        toks, probs = chain_body(r, ex, vg.vbuf, hidden, buf, width, k)
    else:
        bsz = vg.bucket
        host = chain_host(c, nxt, hidden.shape[0], bsz, k, mb, ex.leader)
        key = ("spec_chain", bsz, width, any(c.top_k), any(p < 1.0 for p in c.top_p))  # alike on every rank
        if key not in r.graphs:
            r.graphs[key] = capture_chain(r, ex, vg.vbuf, hidden, host, width, k)
        graph, buf, (toks, probs) = r.graphs[key]
        for name, val in host.items():
            buf[name].copy_(val, non_blocking=True)
        graph.replay()
    if not ex.leader:
        return None
    ids = toks[:, :n].t().clone(memory_format=torch.contiguous_format)  # [n, K], out of the graph's buffers
    pr = probs[:, :n].transpose(0, 1).clone(memory_format=torch.contiguous_format)  # [n, K, V]
    tk = ids.tolist() if ex.group is not None else [None] * n  # TP: the next verify's ids are broadcast as lists
    return [(t if t is None else t[:kb], kb, pr, i, ids) for i, (t, kb) in enumerate(zip(tk, c.kbs))]


def capture_plain(r, ex, bsz: int, width: int, c) -> int:
    """Capture (at start) the chain graph of bucket ``bsz`` for rows without top-k/top-p, on the verify graph's
    static buffers and hidden rows (every slot -1 then: nothing written); ``c``: an empty ``Chain``. 1 if
    captured, 0 if it was there."""
    key = ("spec_chain", bsz, width, False, False)
    if key in r.graphs:
        return 0
    _, vbuf, (hidden, _) = r.graphs[("verify", bsz, width)]
    host = chain_host(c, [], hidden.shape[0], bsz, width - 1, r.max_blocks_per_seq, ex.leader)
    r.graphs[key] = capture_chain(r, ex, vbuf, hidden, host, width, width - 1)
    return 1


def capture_chain(r, ex, vbuf, hidden, host: dict, width: int, k: int) -> tuple:
    """Capture ``chain_body`` (warm-ups on a side stream first, the runner's pool): (graph, buf, outputs). Warm-ups
    and capture write the draft's K/V at the verify's slots as the replay right after does (same values)."""
    buf = {name: v.to(r.device, copy=True) for name, v in host.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            chain_body(r, ex, vbuf, hidden, buf, width, k)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=r.graph_pool):
        out = chain_body(r, ex, vbuf, hidden, buf, width, k)
    return graph, buf, out
