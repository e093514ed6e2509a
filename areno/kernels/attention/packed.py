"""Packed variable-length attention: Triton forward/backward, native PyTorch path, float64 reference, dispatch.

    S = scale * Q K^T,  P = softmax(S) over the keys a query may see,  O = P V
    query i of a sequence with Lq queries and Lk keys sees keys j <= i + (Lk - Lq)   (causal, aligned to the END,
    so a chunk of queries attends to the cached keys before it; Lq == Lk is the usual causal mask)

Layout: q [Tq, Hq, D], k/v [Tk, Hkv, D], sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]; GQA/MQA: query head h
reads KV head h // (Hq // Hkv). A query row with no visible key (only when Lq > Lk) outputs 0.

Tiling (FlashAttention-2): the forward runs one program per (BLOCK_M query rows, sequence, query head), streams
BLOCK_N keys at a time with an online softmax in base 2 (fp32 m, l, acc), and saves LSE (log2 units) for the
backward. Key blocks fully visible to every row of the tile run without masks; only the diagonal band and the
sequence tail pay for the mask, and blocks past the diagonal are skipped. The backward recomputes P from LSE:
delta = rowsum(dO * O) first, then dK/dV with one program per (BLOCK_N keys, sequence, KV head) iterating over the
query blocks of every query head of its group (no atomics), then dQ with one program per query block.
FLOPs (causal, Lq == Lk = L): forward 4 * H * L^2 * D / 2, backward 2.5x that.

Sliding window (``window=W``, causal only): query i also needs j > i + (Lk - Lq) - W. The kernels take W as a
runtime int plus a constexpr HAS_WINDOW (False compiles the full-attention code unchanged: sm_90 PTX compared):
whole key blocks left of a query tile's window are skipped (cost O(L * W), not O(L^2)), the blocks the window's
left edge cuts are masked, those every row sees fully run unmasked; the dK/dV kernel skips the query blocks past a
key tile's last window. Forward "default" and "tma", backward "split" and "tma_merged" (window calls run the Gluon
forward as "tma" and the Gluon backward as "tma_merged").
Attention sinks (``sinks [Hq]``, GPT-OSS): one more logit per head in every row's softmax, with no value. The
forward adds 2^(sink - m) to the row's denominator at the end, so O and LSE count it; the backward kernels are
then unchanged, and d sinks[h] = -sum_rows 2^(sink log2 e - LSE) * delta is computed outside them (``sink_grad``).
Forward "default" / "tma" (Gluon runs as "tma"), every backward variant.

Backward variants ("auto", the default, is "gluon" on sm_90 where the installed Triton has Gluon, "tma_merged" on
other sm_90+ and "split" elsewhere, the interpreter included; a benchmark picks one with ``attention(..., _bwd=)``):
- "split": the dK/dV kernel above, then a dQ kernel that recomputes S and dP per query block: seven
  [BLOCK, BLOCK, D] matmuls per (query block, key block) pair, 3.5x the forward's FLOPs, no atomics. The fallback
  where TMA does not apply (GPUs before sm_90, layouts a descriptor cannot address, the interpreter's default).
- "tma_merged": the split pair with every Q/K/V/dO tile moved by Hopper TMA descriptors, in one launch: program
  (t, sequence, KV head) runs the dK/dV program of key tile t and the dQ program of query tile t for each query
  head of the group, one after the other (the order is part of the tuned config); causal with Lq == Lk the heavy key
  tiles pair with the light query tiles, so every program does the same work (``tma.py``). Where TMA does not apply
  it runs the pointer "split" pair. The fallback of "gluon" (other head dims, fp32, no Gluon).
- "gluon": the single pass written in Gluon (``gluon.py``, d128 bf16/fp16 on sm_90): warp-specialized as
  FlashAttention-3's backward is, five products per pair, dQ partials added by TMA reduces into an fp32
  accumulator (which the delta kernel zeroes); "tma_merged" where it does not apply, and "split" where TMA does not.
  dQ's fp32 summation order varies from run to run (last-bit differences; dK/dV are deterministic).
Measured and removed (docs/kernels.md): a fused pointer pass with dQ by fp32 atomics, its TMA twin with dQ by bulk
reduce, and the TMA split pair in two launches.

Forward variants (``_fwd=``): "default" (the pointer kernel above), "tma" (the same kernel with TMA descriptors,
``tma.py``) or "gluon" (``gluon.py``: written in Gluon, for d128 warp-specialized as FlashAttention-3 is, a load
warp and two consumer warpgroups sharing each K / V tile); "auto" (the default) is "gluon" on sm_90 where the
installed Triton has Gluon, "tma" on other sm_90+, else "default". The TMA variants apply to head_dim
16/32/64/128/256 with heads packed in the last two dims (``tma.tma_layout_ok``); other inputs, and GPUs before
sm_90, run the pointer kernels.

The pointer and TMA kernels are built from the same ``@triton.jit`` pieces in ``common.py`` (the forward, dQ and
dK/dV inner loops, tile and block bounds), each taking a constexpr ``TMA`` that picks pointer or descriptor
loads; Triton inlines them, so every kernel compiles as it did with its own copy (sm_90 PTX compared).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from areno.kernels._device import has_tma
from areno.kernels.attention import gluon as attention_gluon
from areno.kernels.attention import tma
from areno.kernels.attention.common import (
    add_sink,
    dq_inner,
    fwd_inner,
    key_tile,
    kv_bounds,
    kv_inner,
    kv_window_bounds,
    load_rows,
    q_bounds,
    q_window_bounds,
    query_tile,
    seq_span,
    tile_config,
)
from areno.kernels.dispatch import autotune_candidates, interpreting, use_triton

_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256

# Tile sizes used under TRITON_INTERPRET=1, where autotuning cannot run (tests may change them).
# A "<kind>_tma" kernel without its own entry uses its pointer twin's tiles.
# "bwd_merged_tma" (no pointer twin): (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, DQ_FIRST): phase 1's (dK/dV) and
# phase 2's (dQ) tiles, and whether phase 2 runs first.
INTERPRET_BLOCKS = {"fwd": (32, 16), "dkdv": (32, 16), "dq": (32, 16), "bwd_merged_tma": (16, 32, 32, 16, True)}
BWD_VARIANTS = ("auto", "split", "tma_merged", "gluon")
# Kernel kinds whose config constexprs are not (BLOCK_M, BLOCK_N), in INTERPRET_BLOCKS order, and the constexpr that
# sizes grid dim 0 of each kind that is not a query-tile launch (BLOCK_M).
_BLOCK_NAMES = {"bwd_merged_tma": ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "DQ_FIRST")}
_GRID_AXIS = {"dkdv": "BLOCK_N", "bwd_merged_tma": "BLOCK_N1"}
FWD_VARIANTS = ("auto", "default", "tma", "gluon")


def _check_variant(kind: str, variant: str | None, choices: tuple) -> str:
    variant = "auto" if variant is None else variant
    if variant not in choices:
        raise ValueError(f"attention: _{kind} must be one of {choices} or None, got {variant!r}")
    return variant


def backward_variant(variant: str | None = None) -> str:
    """The backward that runs: ``variant`` ("split", "tma_merged", "gluon"; None or "auto": "gluon" on sm_90+ where
    this Triton has Gluon, else "tma_merged" on sm_90+, else "split"). TMA kinds fall back to the pointer "split"
    pair where ``_use_tma`` says no, "gluon" to "tma_merged" where it does not apply (module docstring)."""
    variant = _check_variant("bwd", variant, BWD_VARIANTS)
    if variant == "auto":
        return ("gluon" if attention_gluon.available() else "tma_merged") if hopper() else "split"
    return variant


def forward_variant(variant: str | None = None) -> str:
    """The forward that runs: ``variant`` ("default": pointer loads, "tma": TMA descriptors, "gluon": the Gluon
    kernels of ``gluon.py``, sm_90 bf16/fp16, inputs they do not apply to run "tma"; None or "auto": "gluon" on
    sm_90+ where this Triton has Gluon, else "tma" on sm_90+, else "default")."""
    variant = _check_variant("fwd", variant, FWD_VARIANTS)
    if variant != "auto":
        return variant
    return ("gluon" if attention_gluon.available() else "tma") if hopper() else "default"


@functools.cache
def hopper() -> bool:
    """A compiled (not interpreted) run on an sm_90+ GPU: where the TMA variants measured faster (H200, K1 at 4k:
    fwd+bwd 4.96 ms vs the pointer pair's 6.07; the merged backward's one launch 3.44 ms of kernel time vs the TMA
    pair's 3.56, batch 4 (T2's attention) 1.77 vs 1.86)."""
    return not interpreting() and torch.cuda.is_available() and has_tma()


def _use_tma(*tensors: torch.Tensor) -> bool:
    """The TMA kernels run on sm_90+ (or interpreted) for layouts a [T, H * D] descriptor can address."""
    if not interpreting() and not has_tma(tensors[0].device):
        return False
    return tma.tma_layout_ok(*tensors)


@triton.jit(do_not_specialize=["stride_lh"])
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, SINKS, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    GROUP, SEQ_BUCKET, WINDOW,
    D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    start_m, b, h, q_start, Lq = query_tile(CU_Q)
    if start_m * BLOCK_M >= Lq:
        return
    k_start, Lk = seq_span(CU_K, b)
    diag = Lk - Lq
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
    q = load_rows(q_ptrs, offs_m, Lq, offs_d, D, True, EVEN_D)
    k_ptrs = K + k_start.to(tl.int64) * stride_kt + hk * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = V + k_start.to(tl.int64) * stride_vt + hk * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi, full = kv_bounds(start_m, Lk, diag, BLOCK_M, BLOCK_N, CAUSAL)
    lo_full = 0
    if HAS_WINDOW:  # blocks left of the window skipped, its left edge masked
        lo, lo_full = kv_window_bounds(start_m, diag, full, WINDOW, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kt, stride_vt, 0, 0, offs_m, offs_n,
                                  offs_d, lo, lo_full, diag, Lk, qk_scale, WINDOW, D, BLOCK_N, EVEN_D, CAUSAL, True,
                                  DOT_PREC, False, True)
    acc, l_i, m_i = fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kt, stride_vt, 0, 0, offs_m, offs_n, offs_d,
                              lo_full, full, diag, Lk, qk_scale, WINDOW, D, BLOCK_N, EVEN_D, CAUSAL, False, DOT_PREC,
                              False, False)
    acc, l_i, m_i = fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kt, stride_vt, 0, 0, offs_m, offs_n, offs_d,
                              full, hi, diag, Lk, qk_scale, WINDOW, D, BLOCK_N, EVEN_D, CAUSAL, True, DOT_PREC, False,
                              HAS_WINDOW)
    if HAS_SINKS:
        acc, l_i, m_i = add_sink(acc, l_i, m_i, tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    # +inf LSE makes every recomputed probability of an empty row exactly 0 in the backward.
    lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    o_ptrs = O + q_start.to(tl.int64) * stride_ot + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    row_ok = offs_m < Lq
    if EVEN_D:
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))
    tl.store(LSE + h * stride_lh + q_start + offs_m, lse, mask=row_ok)


@triton.jit(do_not_specialize=["T", "stride_lh"])
def _attn_bwd_delta_kernel(O, DO, DELTA, DQ, T, stride_ot, stride_oh, stride_dt, stride_dh, stride_lh, stride_dqt,
                           stride_dqh, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                           ZERO_DQ: tl.constexpr):
    # delta[h, t] = sum_d dO[t, h, d] * O[t, h, d]  (= rowsum(P * dP), the softmax-backward correction);
    # ZERO_DQ (single-pass backward): also clear the rows of the fp32 dQ accumulator, saving a memset launch.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < T) & (offs_d[None, :] < D)
    rows64 = rows.to(tl.int64)
    o = tl.load(O + rows64[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows64[:, None] * stride_dt + h * stride_dh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h * stride_lh + rows, delta, mask=rows < T)
    if ZERO_DQ:
        tl.store(DQ + rows64[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
                 tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32), mask=mask)


@triton.jit
def _load_kv_tile(K, V, k_start, hk, cols, offs_d, Lk, stride_kt, stride_kh, stride_vt, stride_vh, D: tl.constexpr,
                  EVEN_D: tl.constexpr):
    # Key rows past Lk load as 0; their dK/dV rows are garbage but never stored, and they touch nothing else.
    k = load_rows(K + k_start.to(tl.int64) * stride_kt + hk * stride_kh + cols[:, None] * stride_kt
                  + offs_d[None, :], cols, Lk, offs_d, D, True, EVEN_D)
    v = load_rows(V + k_start.to(tl.int64) * stride_vt + hk * stride_vh + cols[:, None] * stride_vt
                  + offs_d[None, :], cols, Lk, offs_d, D, True, EVEN_D)
    return k, v


@triton.jit
def _store_kv_grads(DK, DV, dk, dv, k_start, hk, cols, offs_d, Lk, sm_scale, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, D: tl.constexpr, EVEN_D: tl.constexpr):
    dk = dk * sm_scale
    mask = cols[:, None] < Lk
    if not EVEN_D:
        mask = mask & (offs_d[None, :] < D)
    dk_ptrs = DK + k_start.to(tl.int64) * stride_dkt + hk * stride_dkh + cols[:, None] * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + k_start.to(tl.int64) * stride_dvt + hk * stride_dvh + cols[:, None] * stride_dvt + offs_d[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_lh"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, CU_Q, CU_K, qk_scale, sm_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    GROUP, SEQ_BUCKET, WINDOW,
    D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    start_n, b, hk, k_start, Lk = key_tile(CU_K)
    if start_n * BLOCK_N >= Lk:
        return
    q_start, Lq = seq_span(CU_Q, b)
    diag = Lk - Lq
    offs_m = tl.arange(0, BLOCK_M)
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k, v = _load_kv_tile(K, V, k_start, hk, cols, offs_d, Lk, stride_kt, stride_kh, stride_vt, stride_vh, D, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query blocks: [m_lo, a1) cross the diagonal (causal mask), [a1, end) see every key of the tile; both loops mask
    # the rows past Lq through their loads (LSE +inf there), which costs no extra ALU work per element. A third,
    # load-mask-free loop for the interior blocks measured as more spills (sm_90, ptxas) for no gain in work.
    m_lo, a1, end = q_bounds(start_n, Lq, diag, BLOCK_M, BLOCK_N, CAUSAL)
    u = end
    if HAS_WINDOW:  # [a1, u) unmasked, [u, end) the window's masked edge, later blocks see none of the tile
        u, end = q_window_bounds(start_n, diag, a1, end, WINDOW, BLOCK_M, BLOCK_N)
    q_base = Q + q_start.to(tl.int64) * stride_qt + offs_m[:, None] * stride_qt + offs_d[None, :]
    do_base = DO + q_start.to(tl.int64) * stride_dot + offs_m[:, None] * stride_dot + offs_d[None, :]
    for g in range(GROUP):
        h = hk * GROUP + g
        q_ptrs = q_base + h * stride_qh
        do_ptrs = do_base + h * stride_doh
        lse_ptrs = LSE + h * stride_lh + q_start + offs_m
        delta_ptrs = DELTA + h * stride_lh + q_start + offs_m
        dk, dv = kv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qt, stride_dot, 0, 0, offs_m,
                          cols, offs_d, m_lo, a1, Lq, Lk, diag, qk_scale, WINDOW, D, BLOCK_M, EVEN_D, CAUSAL,
                          DOT_PREC, False, False, HAS_WINDOW)
        dk, dv = kv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qt, stride_dot, 0, 0, offs_m,
                          cols, offs_d, a1, u, Lq, Lk, diag, qk_scale, WINDOW, D, BLOCK_M, EVEN_D, False, DOT_PREC,
                          False, False, False)
        if HAS_WINDOW:
            dk, dv = kv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qt, stride_dot, 0, 0,
                              offs_m, cols, offs_d, u, end, Lq, Lk, diag, qk_scale, WINDOW, D, BLOCK_M, EVEN_D, False,
                              DOT_PREC, False, False, True)
    _store_kv_grads(DK, DV, dk, dv, k_start, hk, cols, offs_d, Lk, sm_scale, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, D, EVEN_D)


@triton.jit(do_not_specialize=["stride_lh"])
def _attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, CU_Q, CU_K, qk_scale, sm_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lh,
    GROUP, SEQ_BUCKET, WINDOW,
    D: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    start_m, b, h, q_start, Lq = query_tile(CU_Q)
    if start_m * BLOCK_M >= Lq:
        return
    k_start, Lk = seq_span(CU_K, b)
    diag = Lk - Lq
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    q = load_rows(Q + q_start.to(tl.int64) * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt
                  + offs_d[None, :], offs_m, Lq, offs_d, D, True, EVEN_D)
    do = load_rows(DO + q_start.to(tl.int64) * stride_dot + h * stride_doh + offs_m[:, None] * stride_dot
                   + offs_d[None, :], offs_m, Lq, offs_d, D, True, EVEN_D)
    lse = tl.load(LSE + h * stride_lh + q_start + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + h * stride_lh + q_start + offs_m, mask=row_ok, other=0.0)
    k_ptrs = K + k_start.to(tl.int64) * stride_kt + hk * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = V + k_start.to(tl.int64) * stride_vt + hk * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi, full = kv_bounds(start_m, Lk, diag, BLOCK_M, BLOCK_N, CAUSAL)
    lo_full = 0
    if HAS_WINDOW:  # as in the forward: blocks left of the window skipped, its left edge masked
        lo, lo_full = kv_window_bounds(start_m, diag, full, WINDOW, BLOCK_M, BLOCK_N)
        dq = dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kt, stride_vt, 0, 0, offs_m, offs_n, offs_d, lo,
                      lo_full, diag, Lk, qk_scale, WINDOW, D, BLOCK_N, EVEN_D, CAUSAL, True, DOT_PREC, False, True)
    dq = dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kt, stride_vt, 0, 0, offs_m, offs_n, offs_d, lo_full,
                  full, diag, Lk, qk_scale, WINDOW, D, BLOCK_N, EVEN_D, CAUSAL, False, DOT_PREC, False, False)
    dq = dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kt, stride_vt, 0, 0, offs_m, offs_n, offs_d, full, hi,
                  diag, Lk, qk_scale, WINDOW, D, BLOCK_N, EVEN_D, CAUSAL, True, DOT_PREC, False, HAS_WINDOW)
    dq = dq * sm_scale
    mask = row_ok[:, None]
    if not EVEN_D:
        mask = mask & (offs_d[None, :] < D)
    dq_ptrs = DQ + q_start.to(tl.int64) * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers


_cfg = tile_config


# Candidates per kernel and head-dim class (<= 64, <= 128, <= 256), chosen for sm_90 by compiling offline (ptxas,
# bf16): each fits shared memory and spills little (<= ~300 bytes; most none). BLOCK_M is always the query tile and
# BLOCK_N the key tile; the dK/dV kernel wants a tall key tile (its two fp32 accumulators are [BLOCK_N, D]) and
# a short query step.
CONFIGS = {
    ("fwd", 64): [_cfg(128, 64, 4, 3), _cfg(128, 128, 8, 3), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 4)],
    ("fwd", 128): [_cfg(128, 64, 8, 3), _cfg(128, 64, 8, 4), _cfg(128, 128, 8, 2), _cfg(64, 128, 8, 3),
                   _cfg(64, 64, 4, 3)],
    ("fwd", 256): [_cfg(64, 64, 8, 2), _cfg(128, 32, 8, 2), _cfg(64, 32, 4, 2)],
    ("dkdv", 64): [_cfg(32, 128, 8, 3), _cfg(64, 128, 8, 3), _cfg(32, 64, 4, 3), _cfg(16, 128, 8, 4)],
    ("dkdv", 128): [_cfg(16, 128, 8, 3), _cfg(16, 128, 8, 4), _cfg(32, 128, 8, 2), _cfg(32, 128, 8, 3),
                    _cfg(64, 64, 8, 3), _cfg(64, 128, 8, 2)],
    ("dkdv", 256): [_cfg(16, 64, 8, 2), _cfg(32, 64, 8, 2), _cfg(32, 32, 4, 2)],
    ("dq", 64): [_cfg(128, 64, 8, 3), _cfg(128, 32, 4, 3), _cfg(64, 64, 4, 3), _cfg(128, 128, 8, 3)],
    ("dq", 128): [_cfg(128, 64, 8, 3), _cfg(128, 64, 8, 4), _cfg(128, 32, 8, 3), _cfg(64, 64, 4, 4),
                  _cfg(64, 64, 4, 2)],
    ("dq", 256): [_cfg(64, 32, 8, 2), _cfg(128, 32, 8, 2), _cfg(32, 32, 4, 2)],
}
CONFIGS.update(tma.CONFIGS)
_KERNELS = {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel, "dq": _attn_bwd_dq_kernel, **tma.KERNELS}


@functools.cache
def autotuned(kind: str, dim_class: int):
    """Kernel ``kind``'s autotuner over its candidates for one head-dim class (built once)."""
    key = ["SEQ_BUCKET", "BLOCK_D", "CAUSAL", "GROUP"]
    configs = autotune_candidates(_SWEEP.get((kind, dim_class), CONFIGS[(kind, dim_class)]))
    return triton.autotune(configs=configs, key=key)(_KERNELS[kind])


_SWEEP: dict = {}  # (kind, head-dim class) -> the candidates a benchmark sweeps instead of CONFIGS' list


def sweep_candidates(kind: str, dim_class: int, configs: list | None) -> None:
    """For a benchmark's sweep: autotune kernel ``kind`` over ``configs`` (None: back to its own list) from the
    next launch on; ``bench/attention.py --sweep`` prints each candidate's time."""
    if configs is None:
        _SWEEP.pop((kind, dim_class), None)
    else:
        _SWEEP[(kind, dim_class)] = list(configs)
    autotuned.cache_clear()


def _dim_class(block_d: int) -> int:
    return 64 if block_d <= 64 else (128 if block_d <= 128 else 256)


# Pin one triton.Config per kernel kind ("fwd", "dkdv", "dq", ...), bypassing autotune: GPU tests use it to check every
# candidate the autotuner might pick. Under TRITON_INTERPRET=1, INTERPRET_BLOCKS applies instead.
FORCE_CONFIG: dict = {}


def launch_kernel(kind: str, grid_rows: int, grid_rest: tuple, block_d: int, seq_bucket: int, *args, **kwargs):
    """Run kernel ``kind`` with grid (cdiv(grid_rows, tile), *grid_rest): autotuned on GPU, one config interpreted.

    TMA kinds take their descriptors positionally; each config's pre_hook (or the code below) sizes their blocks.
    """
    base = kind.removesuffix("_tma")
    tile_axis = _GRID_AXIS.get(kind, "BLOCK_M")
    kwargs.update(SEQ_BUCKET=seq_bucket, BLOCK_D=block_d)
    kernel = _KERNELS[kind]
    if interpreting():
        tiles = INTERPRET_BLOCKS[kind] if kind in INTERPRET_BLOCKS else INTERPRET_BLOCKS[base]
        blocks = dict(zip(_BLOCK_NAMES.get(kind, ("BLOCK_M", "BLOCK_N")), tiles, strict=True))
        if kind == "bwd_merged_tma":
            tma.check_merged_blocks(blocks)
        tma.fit_descriptors({**dict(zip(kernel.arg_names, args)), **blocks})
        kernel[(triton.cdiv(grid_rows, blocks[tile_axis]), *grid_rest)](*args, **blocks, **kwargs)
    elif kind in FORCE_CONFIG:
        cfg = FORCE_CONFIG[kind]
        if kind == "bwd_merged_tma":
            tma.check_merged_blocks(cfg.kwargs)
        tma.fit_descriptors({**dict(zip(kernel.arg_names, args)), **cfg.kwargs})
        grid = (triton.cdiv(grid_rows, cfg.kwargs[tile_axis]), *grid_rest)
        kernel[grid](*args, **cfg.kwargs, **kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        grid = lambda meta: (triton.cdiv(grid_rows, meta[tile_axis]), *grid_rest)
        autotuned(kind, _dim_class(block_d))[grid](*args, **kwargs)


def _seq_bucket(n: int) -> int:
    return min(max(triton.next_power_of_2(max(n, 1)), 64), 16384)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs stay exact; half inputs ignore it


def attention_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, variant="default", window=None, sinks=None):
    """O and LSE (log2 units, ``[Hq, Tq]`` fp32; with sinks it counts the sink) of the Triton forward ``variant``; a
    window or sinks run "gluon" as "tma" (the Gluon kernels take neither)."""
    Tq, Hq, D = q.shape
    B = cu_q.numel() - 1
    o = torch.empty_like(q)
    lse = torch.empty((Hq, Tq), device=q.device, dtype=torch.float32)
    block_d = max(triton.next_power_of_2(D), 16)
    extras = dict(WINDOW=window or 0, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None)
    sinks = lse if sinks is None else sinks  # (a pointer the kernels do not read)
    if variant == "gluon" and (extras["HAS_WINDOW"] or extras["HAS_SINKS"]):
        variant = "tma"
    if max_q > 0 and B > 0 and variant == "gluon" and attention_gluon.applies(q, k, v) is None:
        attention_gluon.forward(q, k, v, o, lse, cu_q, cu_k, max_q, _seq_bucket(max(max_q, max_k)), causal,
                                scale * _LOG2E)
    elif max_q > 0 and B > 0 and variant in ("tma", "gluon") and _use_tma(q, k, v, o):
        launch_kernel(
            "fwd_tma", max_q, (B, Hq), block_d, _seq_bucket(max(max_q, max_k)),
            tma.descriptor(q), tma.descriptor(k), tma.descriptor(v), tma.descriptor(o), o, lse, cu_q, cu_k, sinks,
            scale * _LOG2E, o.stride(0), o.stride(1), lse.stride(0), Hq // k.shape[1],
            CAUSAL=causal, DOT_PREC=_dot_precision(q.dtype), **extras,
        )  # fmt: skip
    elif max_q > 0 and B > 0:
        launch_kernel(
            "fwd", max_q, (B, Hq), block_d, _seq_bucket(max(max_q, max_k)),
            q, k, v, o, lse, cu_q, cu_k, sinks, scale * _LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
            lse.stride(0), Hq // k.shape[1],
            D=D, EVEN_D=block_d == D, CAUSAL=causal, DOT_PREC=_dot_precision(q.dtype), **extras,
        )  # fmt: skip
    return o, lse


def attention_bwd(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, variant="split", window=None):
    """dQ, dK, dV of the Triton backward ``variant`` given the forward's O and LSE (which counts the sinks: the
    kernels need nothing else for them); a window runs "gluon" as "tma_merged" (the Gluon kernel takes none)."""
    if window is not None and variant == "gluon":
        variant = "tma_merged"
    Tq, Hq, D = q.shape
    Hkv = k.shape[1]
    B = cu_q.numel() - 1
    block_d = max(triton.next_power_of_2(D), 16)
    use_tma = variant in ("tma_merged", "gluon") and B > 0 and _use_tma(q, k, v, do)
    if variant == "gluon" and not (use_tma and attention_gluon.applies(q, k, v, "bwd") is None):
        variant = "tma_merged"  # where the single pass does not apply: the merged pair (or the pointer split pair)
    single_pass = variant == "gluon"  # dQ accumulates in fp32 (zeroed by the delta kernel below), then is cast
    if use_tma:  # packed [T, H, D], as the output descriptors address them
        dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (k, v))
        dq = torch.empty(q.shape, device=q.device, dtype=torch.float32 if single_pass else q.dtype)
    else:
        dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    delta = torch.empty_like(lse)
    if Tq > 0:
        block_t = 16 if interpreting() else 64
        _attn_bwd_delta_kernel[(triton.cdiv(Tq, block_t), Hq)](
            o, do, delta, dq, Tq, o.stride(0), o.stride(1), do.stride(0), do.stride(1), delta.stride(0),
            dq.stride(0), dq.stride(1), D=D, BLOCK_T=block_t, BLOCK_D=block_d, ZERO_DQ=single_pass,
        )  # fmt: skip
    if B == 0:
        return dq.zero_().to(q.dtype), dk.zero_(), dv.zero_()
    common = dict(D=D, EVEN_D=block_d == D, CAUSAL=causal, DOT_PREC=_dot_precision(q.dtype))
    bucket = _seq_bucket(max(max_q, max_k))
    if single_pass:  # dK, dV and sm_scale * dQ into the zeroed fp32 accumulator
        if max_k > 0:
            attention_gluon.backward(q, k, v, do, dq, dk, dv, lse, delta, cu_q, cu_k, max_k, bucket, causal,
                                     scale * _LOG2E, scale)
        else:
            dk.zero_(), dv.zero_()
        return dq.to(q.dtype), dk, dv
    windowed = dict(common, WINDOW=window or 0, HAS_WINDOW=window is not None)
    if use_tma:
        _attention_bwd_merged_tma(do, q, k, v, dq, dk, dv, lse, delta, cu_q, cu_k, max_q, max_k, causal, scale,
                                  bucket, window)
        return dq.to(q.dtype), dk, dv
    if max_k > 0:
        launch_kernel(
            "dkdv", max_k, (B, Hkv), block_d, bucket,
            q, k, v, do, dk, dv, lse, delta, cu_q, cu_k, scale * _LOG2E, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0), Hq // Hkv, **windowed,
        )  # fmt: skip
    if max_q > 0:
        launch_kernel(
            "dq", max_q, (B, Hq), block_d, bucket,
            q, k, v, do, dq, lse, delta, cu_q, cu_k, scale * _LOG2E, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
            dq.stride(0), dq.stride(1), lse.stride(0), Hq // Hkv, **windowed,
        )  # fmt: skip
    return dq, dk, dv


def _attention_bwd_merged_tma(do, q, k, v, dq, dk, dv, lse, delta, cu_q, cu_k, max_q, max_k, causal, scale, bucket,
                              window=None):
    """The split pair through TMA descriptors in one launch, into packed (contiguous [T, H, D]) dq, dk, dv; grid dim
    0 covers both phases' tiles (BLOCK_M2 == BLOCK_N1)."""
    B, Hq, Hkv, D = cu_q.numel() - 1, q.shape[1], k.shape[1], q.shape[2]
    dq_, dk_, dv_ = (tma.descriptor(t) for t in (dq, dk, dv))
    q_, k_, v_, do_ = (tma.descriptor(t) for t in (q, k, v, do))
    common = dict(CAUSAL=causal, DOT_PREC=_dot_precision(q.dtype), WINDOW=window or 0, HAS_WINDOW=window is not None)
    if max(max_q, max_k) > 0:
        # each phase has its own descriptors (block rows per phase): q, k, v, do again for phase 2
        q2, k2, v2, do2 = (tma.descriptor(t) for t in (q, k, v, do))
        launch_kernel("bwd_merged_tma", max(max_q, max_k), (B, Hkv), D, bucket, q_, k_, v_, do_, dk_, dv_, q2, k2, v2,
                do2, dq_, dq, dk, dv, lse, delta, cu_q, cu_k, scale * _LOG2E, scale, dq.stride(0), dk.stride(0),
                lse.stride(0), Hq // Hkv, **common)
    if max_k == 0:
        dk.zero_()
        dv.zero_()
    if max_q == 0:
        dq.zero_()


def sink_grad(sinks, o, do, lse, cu_q):
    """d sinks[h] = -sum over h's query rows of p_sink * delta, p_sink = 2^(sink log2(e) - LSE) (the sink's softmax
    weight, LSE counting it), delta = rowsum(dO * O); rows past cu_q[-1] belong to no sequence."""
    delta = (o.float() * do.float()).sum(-1).t()  # [Hq, Tq]
    p_sink = torch.exp2(sinks.float()[:, None] * _LOG2E - lse)
    rows = torch.arange(lse.shape[1], device=lse.device) < cu_q[-1]
    return -torch.where(rows, p_sink * delta, 0.0).sum(1).to(sinks.dtype)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, causal, scale, window, fwd_variant, bwd_variant):
        o, lse = attention_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, fwd_variant, window, sinks)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, sinks)
        ctx.args = (max_q, max_k, causal, scale, bwd_variant, window)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_q, cu_k, sinks = ctx.saved_tensors
        do = do if do.stride(-1) == 1 else do.contiguous()
        if ctx.args[-2] in ("tma_merged", "gluon") and not tma.tma_layout_ok(do):
            do = do.contiguous()  # e.g. an expanded gradient: pack it for the descriptors
        dq, dk, dv = attention_bwd(do, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
        dsinks = sink_grad(sinks, o, do, lse, cu_q) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, *([None] * 9)


# ---------------------------------------------------------------------------------------------------------------
# Reference and native paths


def _visible(Lq: int, Lk: int, causal: bool, device, window: int | None = None) -> torch.Tensor | None:
    """[Lq, Lk] bool mask of the keys each query sees (end-aligned causal; with a ``window`` only the last
    ``window`` keys up to and including its own position), or None when it sees all of them."""
    if not causal:
        return None
    i = torch.arange(Lq, device=device)[:, None]
    j = torch.arange(Lk, device=device)[None, :]
    keep = j <= i + (Lk - Lq)
    return keep if window is None else keep & (j > i + (Lk - Lq) - window)


def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, softmax_scale=None, window=None,
                        sinks=None):
    """Plain per-sequence softmax(scale * q k^T) v in the inputs' own dtype (pass float64 for an oracle).

    ``window`` (causal only): a query at (end-aligned) key position p sees keys p - window < j <= p, as
    transformers' ``sliding_window`` (the window counts the query's own key). ``sinks [Hq]``: a per-head logit
    joined to every query's softmax as one more column that carries no value (GPT-OSS; transformers' gpt_oss eager
    attention: concatenate, softmax, drop the column).

    Differentiable (in ``sinks`` too); rows that see no key output 0. Host-syncs on cu_seqlens (a test/CPU path).
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for b in range(len(cq) - 1):
        qs, ks, vs = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        ks = ks.repeat_interleave(group, dim=1)
        vs = vs.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        mask = _visible(qs.shape[0], ks.shape[0], causal, q.device, window)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more column per head, dropped after the softmax
            s = torch.cat([s, sinks.to(s.dtype)[:, None, None].expand(-1, s.shape[1], 1)], -1)
        p = torch.softmax(s, dim=-1)
        if sinks is not None:
            p = p[..., :-1]
        elif mask is not None:
            p = torch.where(mask.any(-1, keepdim=True), p, torch.zeros_like(p))  # empty rows: 0, not NaN
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
    out = torch.cat(outs) if outs else q[:0]
    if out.shape[0] < q.shape[0]:  # rows outside every sequence
        out = torch.cat([out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])])
    return out


def with_sink_key(qp, kp, vp, mask, sinks, scale):
    """SDPA inputs ``[n, H, L, D]`` (and a bool ``mask`` broadcastable to ``[n, 1, Lq, Lk]``, or None) with the
    sinks as one more key that every query sees, scores ``sinks[h]`` and carries a zero value: q gains the column
    ``sinks[h] / scale`` (padded to 8 more dims, as the fused SDPA kernels like), k zeros there, and the extra key is
    ``e_D`` (so SDPA's own scale gives back ``sinks[h]``). Exact, differentiable in every input, GQA kept."""
    n, hq, lq, d = qp.shape
    hkv, lk = kp.shape[1], kp.shape[2]
    pad = 8
    col = (sinks.to(qp.dtype) / scale).view(1, hq, 1, 1).expand(n, hq, lq, 1)
    qp = torch.cat([qp, col, qp.new_zeros(n, hq, lq, pad - 1)], -1)
    sink_key = torch.zeros(pad, dtype=kp.dtype, device=kp.device)
    sink_key[0] = 1
    sink_key = torch.cat([kp.new_zeros(d), sink_key]).expand(n, hkv, 1, d + pad)
    kp = torch.cat([torch.cat([kp, kp.new_zeros(n, hkv, lk, pad)], -1), sink_key], 2)
    vp = torch.cat([vp, vp.new_zeros(n, hkv, 1, vp.shape[-1])], 2)
    if mask is None:
        mask = torch.ones(1, 1, lq, lk, dtype=torch.bool, device=qp.device)
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], -1)
    return qp, kp, vp, mask


def _attention_sdpa(q, k, v, cu_q, cu_k, causal, scale, window=None, sinks=None):
    """CUDA native path: torch SDPA per sequence (flash/cuDNN/efficient as torch picks), differentiable."""
    import torch.nn.functional as F

    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs = []
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]
        ks = k[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        vs = v[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        Lq, Lk = qs.shape[2], ks.shape[2]
        if causal and Lq > Lk and sinks is None:  # some rows see nothing: SDPA would give NaN there
            outs.append(attention_reference(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                                            cu_q.new_tensor([0, Lq]), cu_k.new_tensor([0, Lk]), causal=True,
                                            softmax_scale=scale, window=window))
            continue
        plain = causal and Lq == Lk and window is None and sinks is None
        mask = _visible(Lq, Lk, causal, q.device, window) if causal and not plain else None
        if sinks is not None:  # the sink key keeps every row non-empty
            qs, ks, vs, mask = with_sink_key(qs, ks, vs, mask, sinks, scale)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=plain, scale=scale,
                                           enable_gqa=ks.shape[1] != qs.shape[1])
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs) if outs else q[:0]
    if out.shape[0] < q.shape[0]:
        out = torch.cat([out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])])
    return out


def length_groups(lq: list[int], lk: list[int], slack: float = 2.0) -> list[list[int]]:
    """The sequences (with query rows) in groups padded together: longest first, a group grows while its padded
    score count stays within ``slack`` x its sequences' own (plus 4096, so short sequences always batch)."""
    order = sorted((b for b in range(len(lq)) if lq[b] > 0), key=lambda b: -max(lq[b], lk[b]))
    groups, cur, mq, mk, own = [], [], 0, 0, 0
    for b in order:
        nq, nk = max(mq, lq[b]), max(mk, lk[b])
        if cur and (len(cur) + 1) * nq * nk > slack * (own + lq[b] * lk[b]) + 4096:
            groups.append(cur)
            cur, nq, nk, own = [], lq[b], lk[b], 0
        cur.append(b)
        mq, mk, own = nq, nk, own + lq[b] * lk[b]
    return groups + ([cur] if cur else [])


def _attention_cpu_padded(q, k, v, cu_q, cu_k, causal, scale, window=None, sinks=None):
    """CPU native path: sequences of similar length padded into batches, one SDPA call per batch (instead of one
    einsum pair per sequence), differentiable. Rows that see no key output 0; rows outside every sequence too."""
    import torch.nn.functional as F

    cq, ck = cu_q.tolist(), cu_k.tolist()
    lq = [cq[b + 1] - cq[b] for b in range(len(cq) - 1)]
    lk = [ck[b + 1] - ck[b] for b in range(len(ck) - 1)]
    if k.shape[0] == 0:  # no keys at all: the reference's zeros (and its empty gradients)
        return attention_reference(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale, window=window,
                                   sinks=sinks)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    rows_all, vals_all = [], []
    for group in length_groups(lq, lk):
        n_q, n_k = max(lq[b] for b in group), max(lk[b] for b in group)
        sq, sk = (torch.tensor([c[b] for b in group])[:, None] for c in (cq, ck))
        gq, gk = (torch.tensor([lens[b] for b in group])[:, None] for lens in (lq, lk))
        i, j = torch.arange(n_q)[None, :], torch.arange(n_k)[None, :]
        valid_q = i < gq  # [n, n_q]
        idx_q = sq + torch.minimum(i, (gq - 1).clamp(min=0))
        idx_k = (sk + torch.minimum(j, (gk - 1).clamp(min=0))).clamp(max=k.shape[0] - 1)
        visible = (j < gk)[:, None, :].expand(-1, n_q, -1)  # [n, n_q, n_k]
        if causal:
            pos = i[:, :, None] + (gk - gq)[:, :, None]  # each query's end-aligned key position
            visible = visible & (j[:, None, :] <= pos)
            if window is not None:
                visible = visible & (j[:, None, :] > pos - window)
        has_key = visible.any(-1)
        mask = visible | ((~has_key)[:, :, None] & (j == 0)[:, None, :])  # a row with no key reads key 0, then 0
        qp, kp, vp = (t[idx].transpose(1, 2) for t, idx in ((q, idx_q), (k, idx_k), (v, idx_k)))
        mask = mask[:, None]
        if sinks is not None:
            qp, kp, vp, mask = with_sink_key(qp, kp, vp, mask, sinks, scale)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                           enable_gqa=kp.shape[1] != qp.shape[1]).transpose(1, 2)
        o = torch.where(has_key[:, :, None, None], o, torch.zeros((), dtype=o.dtype))
        rows_all.append(idx_q[valid_q])
        vals_all.append(o[valid_q])
    return out.index_copy(0, torch.cat(rows_all), torch.cat(vals_all)) if rows_all else out


def _attention_native(q, k, v, cu_q, cu_k, causal, scale, window=None, sinks=None):
    if q.is_cuda:
        return _attention_sdpa(q, k, v, cu_q, cu_k, causal, scale, window, sinks)
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    sinks = None if sinks is None else sinks.to(compute)
    out = _attention_cpu_padded(q.to(compute), k.to(compute), v.to(compute), cu_q, cu_k, causal, scale, window,
                                sinks)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Public entry point


def _check(q, k, v, cu_q, cu_k):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"attention: q, k, v must be [tokens, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k and v must have the same shape, got {k.shape} and {v.shape}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"attention: q and k head_dim differ ({q.shape[2]} vs {k.shape[2]})")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"attention: query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape:
        raise ValueError(f"attention: cu_seqlens_q/k must be 1-D of equal length [B+1], got {cu_q.shape}, {cu_k.shape}")


def check_window(window, causal: bool) -> int | None:
    """The sliding window as an int >= 1, or None; a window on non-causal attention is refused."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"attention: window must be a positive int or None, got {window!r}")
    if not causal:
        raise ValueError("attention: window (sliding window) needs causal=True")
    return window


def check_sinks(sinks, num_heads: int) -> torch.Tensor | None:
    """The attention sinks as a floating ``[num_heads]`` tensor, or None; anything else is refused in one line."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.shape != (num_heads,):
        what = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"attention: sinks must be a floating tensor [Hq={num_heads}], got {what}")
    return sinks


def _triton_supported(q: torch.Tensor) -> bool:
    # fp32 is for the interpreter tests: on a GPU it would run on CUDA cores (no tensor cores) and spill, so the
    # dispatcher sends it to SDPA instead.
    dtype_ok = q.dtype in (torch.float16, torch.bfloat16) or (q.dtype == torch.float32 and not q.is_cuda)
    return dtype_ok and q.shape[-1] <= MAX_HEAD_DIM


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=True, softmax_scale=None,
              backend=None, window=None, sinks=None, _fwd=None, _bwd=None):
    """Packed varlen attention; ``q [Tq, Hq, D]``, ``k/v [Tk, Hkv, D]``, ``cu_seqlens_*`` int32 ``[B+1]``.

    Causal masks align to the end of each key sequence (query i sees keys j <= i + Lk - Lq). ``max_seqlen_*`` are
    host ints (upper bounds of the per-sequence lengths; they size the grid). ``backend``: None follows
    ``use_triton`` (``ARENO_KERNELS``; what ``--attn-backend flash`` gives); "native" forces PyTorch (SDPA per
    sequence on CUDA, per group of similar-length sequences padded together on the CPU; ``--attn-backend
    native``); "triton" (alias "flash") forces Triton.
    Returns ``[Tq, Hq, D]`` in q's dtype; differentiable in q, k, v (and sinks) on both paths. ``_fwd`` / ``_bwd``:
    the Triton path's forward ("default", "tma", "gluon") and backward ("split", "tma_merged", "gluon") for a
    benchmark or a test to compare; None (or "auto") picks the measured default for the GPU (module docstring).
    ``window``: sliding-window (left) size in keys, causal only, as ``attention_reference``; the Triton kernels skip
    whole key blocks left of it (forward "default"/"tma", backward "split"/"tma_merged"; window calls run the
    Gluon forward as "tma" and the Gluon backward as "tma_merged").
    ``sinks``: ``[Hq]`` per-head sink logits (fp32 or the model's dtype, e.g. a trainable parameter), as
    ``attention_reference``; on the Triton path the forward's LSE counts the sink (forward "default"/"tma"; Gluon
    runs as "tma"; every backward variant) and d sinks is computed from it (``sink_grad``).
    """
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    window = check_window(window, causal)
    sinks = check_sinks(sinks, q.shape[1])
    # an invalid value fails on every path, not only where it would take effect
    fwd_variant, bwd_variant = forward_variant(_fwd), backward_variant(_bwd)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if backend is None:
        run_triton = use_triton(q, k, v, supported=_triton_supported(q))
    elif backend == "native":
        run_triton = False
    elif backend in ("triton", "flash"):
        if not _triton_supported(q):
            raise ValueError(f"attention: Triton path needs fp16/bf16 (fp32 only interpreted) and head_dim <= "
                             f"{MAX_HEAD_DIM}, got {q.dtype}, head_dim {q.shape[-1]}")
        if not (q.is_cuda or interpreting()):
            raise RuntimeError("attention: backend='triton' needs CUDA tensors or TRITON_INTERPRET=1")
        run_triton = True
    else:
        raise ValueError(f"attention: backend must be None, 'native' or 'triton', got {backend!r}")
    if not run_triton:
        return _attention_native(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window, sinks)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    sinks = None if sinks is None else sinks.contiguous()
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k.to(torch.int32)
    return _TritonAttention.apply(q, k, v, sinks, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal),
                                  scale, window, fwd_variant, bwd_variant)
