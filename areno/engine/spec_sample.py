"""A steady speculative step's rejection sampling (``verify_draft``), on the leader, eager or replayed from a CUDA
graph right after the verify forward's (``spec_graphs``), and its one read back to the host.

The graph per (batch bucket, K + 1, logit-adjustment width, filters used) reads the forward graph's static logits
and its own static inputs: the drafts' tokens and distributions (``[bucket, K]``, ``[bucket, K, V]``), each row's
temperature, seed, offset, top-k/top-p (only when a row filters: otherwise the sampler skips them, as eagerly) and
logit adjustments (padded as the decode graphs pad theirs, penalties always present: neutral rows count nothing).
Padding rows verify zeros and are never read. Its output is packed in one float64 tensor ``[bucket, 2 (K + 1) + 1]``
(tokens, log-probs, accepted drafts: all exact in float64), copied to the host once (a pinned buffer,
``spec_graphs.read_back``). Captured on first use, or at server start for rows without adjustments or filters
(``capture_plain``). Without graphs the same body runs on the step's own tensors. A sequence's draft is a ``Draft``;
a steady chain's drafts share its device tensors (tokens ``[n, K]``, distributions ``[n, K, V]``), which the next
step's verify and sampling read as they are (``draft_ids``, ``draft_probs``): no read back between the steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areno.engine.decode_graphs import SPARSE_MIN_WIDTH
from areno.engine.logit_adjust import adjust_host
from areno.engine.spec_exec import filters
from areno.engine.spec_graphs import read_back
from areno.engine.speculative import verify_draft
from areno.engine.step_inputs import StepInputs, host_tensor


@dataclass
class Draft:
    """One sequence's draft: ``size`` (K_b) tokens drawn from ``batch`` (their distributions: ``[K_b, V]`` fp32, or row
    ``row`` of a steady chain's ``[n, K, V]``). A steady chain's tokens stay on the device (``ids [n, K]``, row ``row``:
    the next verify reads them there, nothing is read back); ``tokens`` reads them to the host on first use (the eager
    paths: a step with prefill chunks, a rollback's second forward)."""

    length: int  # len(seq) when drafted: used only while the sequence still has that length
    listed: list[int] | None  # the tokens on the host (None: not read yet)
    size: int
    batch: torch.Tensor
    row: int | None = None
    ids: torch.Tensor | None = None

    @property
    def tokens(self) -> list[int]:
        if self.listed is None:
            self.listed = self.ids[self.row, : self.size].tolist()
        return self.listed

    @property
    def probs(self) -> torch.Tensor:
        """[K_b, V]: the distribution each of its tokens was drawn from."""
        return self.batch if self.row is None else self.batch[self.row, : self.size]


def _rows_of(drafts: list[Draft], field: str) -> torch.Tensor | None:
    """The drafts' rows of one chain's tensor ``field`` (``batch`` or ``ids``): a view when they are its rows 0 ..
    B - 1 in order (a steady batch), one gather when in another order; None when they are not all of one chain."""
    first = getattr(drafts[0], field)
    if drafts[0].row is None or first is None or any(getattr(d, field) is not first for d in drafts):
        return None
    idx = [d.row for d in drafts]
    if idx == list(range(len(idx))):
        return first[: len(idx)]
    return first.index_select(0, torch.tensor(idx, device=first.device))


def draft_probs(drafts: list[Draft]) -> torch.Tensor:
    """The drafts' distributions ``[B, K, V]`` (every draft K tokens): their chain's rows, else stacked."""
    rows = _rows_of(drafts, "batch")
    return rows if rows is not None else torch.stack([d.probs for d in drafts])


def draft_ids(drafts: list[Draft], device) -> torch.Tensor:
    """The drafts' tokens ``[B, K]`` int64 on ``device`` (every draft K tokens): their chain's rows, else from the
    host."""
    rows = _rows_of(drafts, "ids")
    return (rows if rows is not None else host_tensor([d.tokens for d in drafts])).to(device)


def sample_body(r, buf: dict):
    """verify_draft on ``buf`` (no host sync), packed: [rows, 2 (K + 1) + 1] float64."""
    adj = buf.get("adjust")
    out = verify_draft(buf["logits"], buf["draft_tokens"], buf["draft_probs"], buf["num_draft"],
                       temperature=buf["temp"], seeds=buf["seeds"], offsets=buf["offsets"], top_k=buf.get("top_k"),
                       top_p=buf.get("top_p"), adjust=adj, check=False,
                       token_state=r.adjuster.token_state if adj is not None and "pen_slot" in adj else None)
    return torch.cat([out.tokens.double(), out.logprobs.double(), out.accepted[:, None].double()], dim=1)


def _host(inp, bsz: int, k: int, adjust_width: int | None) -> dict:
    """The sampling inputs on the host, padded to ``bsz`` rows (the filters only where some row uses them); the
    draft tokens zeros (the caller writes them on the device: ``draft_ids``)."""
    pad = bsz - len(inp.temperature)
    top_k, top_p = filters(inp.top_k, inp.top_p)
    host = {"draft_tokens": torch.zeros(bsz, k, dtype=torch.int64),
            "num_draft": torch.full((bsz,), k, dtype=torch.int64),
            "temp": host_tensor(inp.temperature + [1.0] * pad, torch.float32),
            "seeds": host_tensor(inp.seeds + [0] * pad), "offsets": host_tensor(inp.offsets + [0] * pad)}
    if top_k is not None:
        host["top_k"] = host_tensor(top_k + [0] * pad)
    if top_p is not None:
        host["top_p"] = host_tensor(top_p + [1.0] * pad, torch.float32)
    if inp.adjust is not None:
        graph = adjust_width is not None
        host["adjust"] = adjust_host(inp.adjust, bsz, adjust_width if graph else inp.adjust.width,
                                     penalties=True if graph else None)
    return host


def _to(host: dict, dev) -> dict:
    """Device copies (new tensors on the CPU too: a graph's buffers never alias the host's)."""
    return {n: (_to(v, dev) if isinstance(v, dict) else v.to(dev, copy=True)) for n, v in host.items()}


def _copy(buf: dict, host: dict) -> None:
    for name, val in host.items():
        if isinstance(val, dict):
            _copy(buf[name], val)
        else:
            buf[name].copy_(val, non_blocking=True)


def draw(r, inp, drafts: list, k: int, logits, bsz: int | None):
    """The steady step's tokens, log-probs and accepted drafts per row (lists; one host read). ``drafts``: each row's
    ``Draft`` (K tokens); ``logits``: the verify's (every row, a replay's padded to ``bsz``; None:
    eager)."""
    B, width, V = len(drafts), k + 1, r.vocab_size
    tokens = inp.draft_ids if inp.draft_ids is not None else draft_ids(drafts, r.device)  # the verify's, or gathered
    probs = draft_probs(drafts)  # on the device, from the chain
    if bsz is None:
        buf = _to(_host(inp, B, k, None), r.device)
        buf["logits"], buf["draft_probs"], buf["draft_tokens"] = logits[: B * width].view(B, width, V), probs, tokens
        packed = sample_body(r, buf)
    else:
        aw = 0 if inp.adjust is None else max(SPARSE_MIN_WIDTH, 1 << (inp.adjust.width - 1).bit_length())
        top_k, top_p = filters(inp.top_k, inp.top_p)
        key = draw_key(bsz, width, aw, top_k is not None, top_p is not None)
        host = _host(inp, bsz, k, aw if inp.adjust is not None else None)
        if key not in r.graphs:
            r.graphs[key] = _capture(r, host, logits, bsz, k, probs.dtype)
        graph, buf, packed = r.graphs[key]
        _copy(buf, host)
        buf["draft_probs"][:B].copy_(probs)
        buf["draft_tokens"][:B].copy_(tokens)
        graph.replay()
        packed = read_back(r, buf, packed)  # pinned, then synchronised
    rows = packed[:B].cpu()
    n = (rows[:, -1].long() + 1).tolist()
    toks = rows[:, :width].long().tolist()
    lps = rows[:, width : 2 * width].float().tolist()
    return [t[:m] for t, m in zip(toks, n)], [lp[:m] for lp, m in zip(lps, n)], [m - 1 for m in n]


def draw_key(bsz: int, width: int, aw: int, top_k: bool, top_p: bool) -> tuple:
    """The sampling graph's key: (bucket, K + 1, logit-adjustment width, top-k used, top-p used)."""
    return "spec_draw", bsz, width, aw, top_k, top_p


def _capture(r, host: dict, logits, bsz: int, k: int, dtype) -> tuple:
    buf = _to(host, r.device)
    if "pen_slot" in buf.get("adjust", {}):  # the warm-ups and capture count into no slot
        buf["adjust"]["pen_slot"].fill_(-1)
    buf["logits"] = logits.view(bsz, k + 1, r.vocab_size)
    buf["draft_probs"] = torch.zeros(bsz, k, r.vocab_size, dtype=dtype, device=r.device)
    return capture_draw(r, buf)


def capture_plain(r, bsz: int, k: int, logits) -> int:
    """Capture (at start) the sampling graph of bucket ``bsz`` for rows without logit adjustments or filters, on
    the verify graph's static ``logits``; 1 if captured, 0 if it was there."""
    key = draw_key(bsz, k + 1, 0, False, False)
    if key in r.graphs:
        return 0
    empty = StepInputs([], [], [], [0], [], [], True, [], [], [], [], [], [], 0, [])
    r.graphs[key] = _capture(r, _host(empty, bsz, k, None), logits, bsz, k, torch.float32)
    return 1


def capture_draw(r, buf: dict) -> tuple:
    """Capture ``sample_body`` on ``buf`` (warm-ups on a side stream, the runner's pool): (graph, buf, packed).
    The warm-ups count padding tokens into no penalty slot (every slot -1 until a step copies its own in)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            sample_body(r, buf)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=r.graph_pool):
        packed = sample_body(r, buf)
    return graph, buf, packed
