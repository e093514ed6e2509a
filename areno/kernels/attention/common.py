"""Triton pieces shared by the pointer kernels (``packed.py``) and the TMA kernels (``tma.py``) of the packed varlen
attention; the math, tiling and causal block split are in ``packed.py``'s docstring.

- ``query_tile``, ``key_tile``, ``seq_span``: a program's tile, sequence and head, and a sequence's rows;
- ``kv_bounds``, ``q_bounds``: the block ranges of the causal split; ``kv_window_bounds``, ``q_window_bounds``: the
  extra ranges of a sliding window (``WINDOW`` a runtime int, ``HAS_WINDOW`` constexpr: full attention compiles as
  before);
- ``add_sink``: the attention sink's term in a row's softmax denominator (end of the forward);
- ``fwd_inner``: the forward's online softmax over a range of key blocks;
- ``dq_inner``: the dQ kernel's loop over key blocks (P recomputed from LSE, dS = P (dP - delta));
- ``kv_inner``: the loop over query blocks of a key tile, accumulating dK and dV;
- ``tile_config``: the autotune candidates' form (host side).

Each loop reads its tiles either through pointers or, with ``TMA`` set, through tensor descriptors over the packed
``[T, H * D]`` view at ``[row0 + tile offset, col]`` (``load_tile``). Triton inlines these functions, so a kernel
compiles to the code it would have with its own copy of the loop (checked on sm_90 PTX when they were factored out).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def seq_span(CU, b):
    """Sequence b's first row and length in the packed tensor: cu[b], cu[b + 1] - cu[b]."""
    start = tl.load(CU + b)
    return start, tl.load(CU + b + 1) - start


@triton.jit
def query_tile(CU_Q):
    """A query-tile program's (tile index, sequence, query head) and its sequence's query rows (first, count).
    Tiles run in reverse: the longest (diagonal-most) ones start first."""
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start, Lq = seq_span(CU_Q, b)
    return start_m, b, h, q_start, Lq


@triton.jit
def key_tile(CU_K):
    """A key-tile program's (tile index, sequence, KV head) and its sequence's key rows (first, count)."""
    start_n = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    k_start, Lk = seq_span(CU_K, b)
    return start_n, b, hk, k_start, Lk


@triton.jit
def kv_bounds(start_m, Lk, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key range [0, hi) a query tile needs, and the prefix [0, full) that every row of the tile sees unmasked."""
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Lk, (start_m + 1) * BLOCK_M + diag), 0)
        full = tl.maximum(tl.minimum(start_m * BLOCK_M + diag + 1, Lk), 0) // BLOCK_N * BLOCK_N
    else:
        hi = Lk
        full = Lk // BLOCK_N * BLOCK_N
    return hi, full


@triton.jit
def kv_window_bounds(start_m, diag, full, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """With a sliding window (query row r sees keys r + diag - WINDOW < j <= r + diag): key blocks left of ``lo``
    are skipped (no row of the tile sees them) and [lo, lo_full) needs the window mask; [lo_full, full) is then the
    unmasked middle (every row sees every key of it), [full, hi) the masked diagonal band as without a window."""
    lo = tl.maximum(start_m * BLOCK_M + diag - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    lo_full = tl.cdiv(tl.maximum((start_m + 1) * BLOCK_M + diag - WINDOW, 0), BLOCK_N) * BLOCK_N
    lo_full = tl.minimum(lo_full, full)
    return tl.minimum(lo, lo_full), lo_full


@triton.jit
def q_window_bounds(start_n, diag, a1, end, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """With a sliding window, the query blocks of a key tile after ``a1`` (``q_bounds``): [a1, u) see every key of
    the tile, [u, e) need the window mask (rows whose window starts inside the tile), blocks from e on see none of
    it and are skipped."""
    e = tl.cdiv(tl.maximum(start_n * BLOCK_N + BLOCK_N - 1 - diag + WINDOW, 0), BLOCK_M) * BLOCK_M
    e = tl.maximum(tl.minimum(e, end), a1)
    u = tl.maximum(start_n * BLOCK_N - diag + WINDOW, 0) // BLOCK_M * BLOCK_M
    return tl.minimum(tl.maximum(u, a1), e), e


@triton.jit
def add_sink(acc, l_i, m_i, sink):
    """The sink (a logit in log2 units, no value) joins the rows' softmax: l += 2^(sink - m), rescaled to the new
    running max. Rows that saw no key end with l = 1 and acc = 0 (output 0, LSE = the sink)."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_new), m_new


@triton.jit
def q_bounds(start_n, Lq, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query blocks a key tile needs: [m_lo, a1) cross the diagonal (causal mask), [a1, end) see every key of it."""
    if CAUSAL:
        m_lo = tl.maximum(start_n * BLOCK_N - diag, 0) // BLOCK_M * BLOCK_M
        m_full = tl.cdiv(tl.maximum(start_n * BLOCK_N + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
    else:
        m_lo = 0
        m_full = 0
    end = tl.cdiv(Lq, BLOCK_M) * BLOCK_M
    return m_lo, tl.maximum(m_lo, tl.minimum(m_full, end)), end


@triton.jit
def keep_mask(cols, offs_m, diag, Lk, WINDOW, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N] keys a query row may see: inside the sequence and, if causal, j <= i + diag (with a
    window also j > i + diag - WINDOW)."""
    keep = cols[None, :] < Lk
    if CAUSAL:
        keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
    if HAS_WINDOW:
        keep = keep & (cols[None, :] > offs_m[:, None] + diag - WINDOW)
    return keep


@triton.jit
def load_rows(ptrs, rows, n_rows, offs_d, D: tl.constexpr, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a [rows, BLOCK_D] tile, masking rows >= n_rows (if ROW_MASK) and padded head-dim columns."""
    if ROW_MASK:
        if EVEN_D:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < D), other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return x


@triton.jit
def load_tile(src, start, offs, n_rows, stride, row0, col, offs_d, D: tl.constexpr, ROW_MASK: tl.constexpr,
              EVEN_D: tl.constexpr, TMA: tl.constexpr, ROW_ADDR: tl.constexpr):
    """One head's tile of rows ``start + offs`` (offs = [0, ROWS)) of a sequence.

    TMA: ``src`` is a descriptor, read at [row0 + start, col] (no masks: rows past the sequence are the next one's).
    Pointers, ROW_ADDR: ``src`` points at the sequence's row 0 of the head, addresses formed from ``rows``; else
    ``src`` is the [ROWS, BLOCK_D] pointer tensor of the tile at start 0. ROW_MASK / EVEN_D as in ``load_rows``.
    """
    if TMA:
        x = src.load([row0 + start, col])
    else:
        rows = start + offs
        if ROW_ADDR:
            x = load_rows(src + rows[:, None] * stride + offs_d[None, :], rows, n_rows, offs_d, D, ROW_MASK, EVEN_D)
        else:
            x = load_rows(src + start * stride, rows, n_rows, offs_d, D, ROW_MASK, EVEN_D)
    return x


@triton.jit
def fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, k_row0, col, offs_m, offs_n, offs_d, lo, hi,
              diag, Lk, qk_scale, WINDOW, D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
              CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
              HAS_WINDOW: tl.constexpr):
    """Key blocks [lo, hi) of the online softmax (base 2, fp32 m_i, l_i, acc) for one query tile.

    MASKED: keys past Lk, (causal) right of the diagonal and (HAS_WINDOW) left of the window score -inf, and rows
    that have seen no key yet keep
    m = -inf without NaNs. The pointer kernel scales the scores first; the TMA kernel keeps the raw dot product and
    folds the scale into the masked select, or (unmasked blocks) into the row max and one FMA per score.
    """
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = load_tile(k_src, start_n, offs_n, Lk, stride_kt, k_row0, col, offs_d, D, MASKED, EVEN_D, TMA, False)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if not TMA:
            qk = qk * qk_scale
        if MASKED:
            keep = keep_mask(start_n + offs_n, offs_m, diag, Lk, WINDOW, CAUSAL, HAS_WINDOW)
            if TMA:
                qk = qk * qk_scale
            qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see no key yet
        elif TMA:  # every row sees every key of the block: max of the raw scores, then one FMA per score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_new
            qk = qk * qk_scale
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = m_new
        p = tl.exp2(qk - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_src, start_n, offs_n, Lk, stride_vt, k_row0, col, offs_d, D, MASKED, EVEN_D, TMA, False)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def dq_inner(dq, q, do, lse, delta, k_src, v_src, stride_kt, stride_vt, k_row0, col, offs_m, offs_n, offs_d, lo, hi,
             diag, Lk, qk_scale, WINDOW, D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
             CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
             HAS_WINDOW: tl.constexpr):
    """dQ (unscaled, fp32) of one query tile over key blocks [lo, hi): dQ += dS K, dS = P (dO V^T - delta)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = load_tile(k_src, start_n, offs_n, Lk, stride_kt, k_row0, col, offs_d, D, MASKED, EVEN_D, TMA, False)
        v = load_tile(v_src, start_n, offs_n, Lk, stride_vt, k_row0, col, offs_d, D, MASKED, EVEN_D, TMA, False)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        p = tl.exp2(qk * qk_scale - lse[:, None])
        if MASKED:  # keys past Lk (TMA: the next sequence's), if causal right of the diagonal, left of a window
            p = tl.where(keep_mask(start_n + offs_n, offs_m, diag, Lk, WINDOW, CAUSAL, HAS_WINDOW), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def kv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, stride_qt, stride_dot, q_row0, col, offs_m, cols,
             offs_d, lo, hi, Lq, Lk, diag, qk_scale, WINDOW, D: tl.constexpr, BLOCK_M: tl.constexpr,
             EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
             ROW_ADDR: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query blocks [lo, hi) of one key tile: dV += P^T dO, dK += dS^T Q (unscaled, fp32, [BLOCK_N, BLOCK_D]).

    CAUSAL / HAS_WINDOW: mask keys right of the diagonal / left of the window. Rows past Lq load LSE = +inf and
    delta = 0, so their P and dS are exactly 0. ROW_ADDR: Q/dO/LSE/delta addresses
    are formed from the row index each step (``lse_src``/``delta_src`` at the sequence's row 0); else they are kept
    as pointer tensors across the loop (at the tile's row 0).
    """
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        if ROW_ADDR:  # (where this compare stands only orders the PTX: each kernel keeps its tuned code)
            row_ok = rows < Lq
        q = load_tile(q_src, start_m, offs_m, Lq, stride_qt, q_row0, col, offs_d, D, True, EVEN_D, TMA, ROW_ADDR)
        if not ROW_ADDR:
            row_ok = rows < Lq
        if ROW_ADDR:
            lse = tl.load(lse_src + rows, mask=row_ok, other=float("inf"))
        else:
            lse = tl.load(lse_src + start_m, mask=row_ok, other=float("inf"))
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_M]
        p_t = tl.exp2(qk_t * qk_scale - lse[None, :])
        if CAUSAL:
            p_t = tl.where(rows[None, :] + diag >= cols[:, None], p_t, 0.0)
        if HAS_WINDOW:
            p_t = tl.where(rows[None, :] + diag - WINDOW < cols[:, None], p_t, 0.0)
        do = load_tile(do_src, start_m, offs_m, Lq, stride_dot, q_row0, col, offs_d, D, True, EVEN_D, TMA, ROW_ADDR)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        if ROW_ADDR:
            delta = tl.load(delta_src + rows, mask=row_ok, other=0.0)
        else:
            delta = tl.load(delta_src + start_m, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PREC)
    return dk, dv


def tile_config(bm: int, bn: int, warps: int, stages: int, pre_hook=None, maxnreg=None) -> triton.Config:
    """An autotune candidate: BLOCK_M (always the query tile) x BLOCK_N (the key tile), warps, pipeline stages;
    ``pre_hook`` runs before each launch with the config (the TMA kernels size their descriptor blocks there);
    ``maxnreg`` caps registers per thread (more programs per SM, at the price of spills)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages, pre_hook=pre_hook,
                         maxnreg=maxnreg)
