"""Hopper (sm_90) TMA variants of the packed varlen attention kernels: the forward (``attention(_fwd="tma")``,
the fallback of "gluon") and the merged backward (``_bwd="tma_merged"``: the split dK/dV + dQ pair's two programs run
one after the other by one program of one launch: key tile t's dK/dV, then query tile t's dQ; the fallback of
"gluon").

Same math, tiling, causal block split and outputs as the pointer kernels in ``packed.py`` (see its docstring),
through the same inner loops (``common.py``, called with ``TMA=True``); what changes is how tiles reach the
tensor cores. Every [rows, D] tile of Q, K, V, dO (and the full tiles of O, dQ,
dK, dV on the way out) moves through a host-built tensor descriptor over the packed 2-D view ``[T, H * D]`` (block
``[BLOCK_M or BLOCK_N, D]``, coordinates ``(sequence start + tile offset, head * D)``): on sm_90 that is a bulk
tensor copy (TMA) into shared memory, software-pipelined ``num_stages`` deep, from which wgmma reads its operands,
instead of per-thread address tensors (a [64, 128] tile of int64 pointers alone is 64 registers per thread) and
register-staged loads. The softmax scale is folded into one FMA with the running max (exp2 units).

Varlen bounds. One descriptor spans the whole packed tensor, so a tile that runs past its sequence's end reads the
next sequence's rows (zeros only past the tensor's end). Those rows are made harmless, not avoided:
- query rows past Lq get LSE = +inf / delta = 0 (masked vector loads), so their P and dS are exactly 0 in the
  backward; in the forward they are computed and then not stored (O and LSE stores are masked / full-tile only);
- key rows past Lk only occur in the masked (diagonal / tail) key blocks of the forward and dQ kernels, where
  ``cols < Lk`` sets their scores to -inf / P to 0; in the dK/dV kernel they only ever touch their own dK/dV rows,
  which are not stored (row n of dK/dV depends on key n alone).
- tma_merged: program (t, b, hk) does the dK/dV kernel's work for key tile t, then the dQ kernel's for query tile t
  of each query head h = hk * GROUP + g, with as many query rows in phase 2 as key rows in phase 1 (BLOCK_M2 ==
  BLOCK_N1). Causal, Lq == Lk: key tile t's work ~ L - t * BLOCK_N1 and query tile t's ~ (t + 1) * BLOCK_M2, so
  every program does the same work and the launch has no tail of short programs. The grid covers the longer of the
  two tile counts (cdiv(max(Lq, Lk), BLOCK_N1)); each phase skips a tile past its own sequence's end. Separate
  descriptors per phase (``desc_q1`` ... ``desc_dq2``) carry each phase's block rows. The phases write disjoint
  outputs, so a config's ``DQ_FIRST`` may run the dQ phase first (fewer spills in the dK/dV loop, see the kernel).
So every stored value equals the pointer kernels' up to summation order.

Applies where the layout allows it (``tma_layout_ok``): head_dim a power of two in [16, 256] (the descriptor's
block is exactly D wide: a padded D would read the next head's columns), heads packed (stride(1) == D,
stride(2) == 1), 16-byte aligned base and row stride. Other inputs run the pointer kernels (the dispatcher in
``packed.py`` decides, per call). Runs under ``TRITON_INTERPRET=1`` (the interpreter emulates descriptors,
including the cross-sequence reads), so the CPU tests check the bounds logic against float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from areno.kernels.attention.common import (
    add_sink,
    dq_inner,
    fwd_inner,
    key_tile,
    kv_bounds,
    kv_inner,
    kv_window_bounds,
    q_bounds,
    q_window_bounds,
    query_tile,
    seq_span,
    tile_config,
)

# Which tile axis sizes each descriptor's block rows: BLOCK_M is always the query tile, BLOCK_N the key tile; the
# merged backward's descriptors are per phase (suffix 1: dK/dV, BLOCK_M1 x BLOCK_N1; suffix 2: dQ, BLOCK_M2 x BLOCK_N2).
_DESC_AXIS = {"desc_q": "BLOCK_M", "desc_o": "BLOCK_M", "desc_do": "BLOCK_M", "desc_dq": "BLOCK_M",
              "desc_k": "BLOCK_N", "desc_v": "BLOCK_N", "desc_dk": "BLOCK_N", "desc_dv": "BLOCK_N",
              "desc_q1": "BLOCK_M1", "desc_do1": "BLOCK_M1", "desc_k1": "BLOCK_N1", "desc_v1": "BLOCK_N1",
              "desc_dk1": "BLOCK_N1", "desc_dv1": "BLOCK_N1",
              "desc_q2": "BLOCK_M2", "desc_do2": "BLOCK_M2", "desc_dq2": "BLOCK_M2", "desc_k2": "BLOCK_N2",
              "desc_v2": "BLOCK_N2"}


def fit_descriptors(args: dict) -> None:
    """Set each descriptor's block to [its tile, D] from BLOCK_M / BLOCK_N (merged backward: BLOCK_M1 ... BLOCK_N2)
    in ``args`` (an autotune pre_hook)."""
    for name, axis in _DESC_AXIS.items():
        desc = args.get(name)
        if isinstance(desc, TensorDescriptor):
            desc.block_shape = [args[axis], desc.block_shape[1]]


def tma_layout_ok(*tensors: torch.Tensor) -> bool:
    """True when every ``[T, H, D]`` tensor can be read through a ``[T, H * D]`` descriptor with a D-wide block."""
    for t in tensors:
        d = t.shape[-1]
        if d < 16 or d > 256 or d & (d - 1) or t.shape[0] == 0:
            return False
        if t.stride(2) != 1 or t.stride(1) != d or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


def descriptor(t: torch.Tensor) -> TensorDescriptor:
    """``[T, H, D]`` -> descriptor over ``[T, H * D]``; the block rows are set per config by ``fit_descriptors``."""
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [16, t.shape[2]])


@triton.jit(do_not_specialize=["stride_lh"])
def _attn_fwd_tma_kernel(
    desc_q, desc_k, desc_v, desc_o, O, LSE, CU_Q, CU_K, SINKS, qk_scale, stride_ot, stride_oh, stride_lh,
    GROUP, SEQ_BUCKET, WINDOW,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    start_m, b, h, q_start, Lq = query_tile(CU_Q)
    if start_m * BLOCK_M >= Lq:
        return
    k_start, Lk = seq_span(CU_K, b)
    diag = Lk - Lq
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([q_start + start_m * BLOCK_M, h * BLOCK_D])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi, full = kv_bounds(start_m, Lk, diag, BLOCK_M, BLOCK_N, CAUSAL)
    col = (h // GROUP) * BLOCK_D
    lo_full = 0
    if HAS_WINDOW:  # as the pointer kernel: blocks left of the window skipped, its left edge masked
        lo, lo_full = kv_window_bounds(start_m, diag, full, WINDOW, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, 0, 0, k_start, col, offs_m, offs_n, 0, lo,
                                  lo_full, diag, Lk, qk_scale, WINDOW, BLOCK_D, BLOCK_N, True, CAUSAL, True, DOT_PREC,
                                  True, True)
    acc, l_i, m_i = fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, 0, 0, k_start, col, offs_m, offs_n, 0, lo_full, full,
                              diag, Lk, qk_scale, WINDOW, BLOCK_D, BLOCK_N, True, CAUSAL, False, DOT_PREC, True, False)
    acc, l_i, m_i = fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, 0, 0, k_start, col, offs_m, offs_n, 0, full, hi, diag,
                              Lk, qk_scale, WINDOW, BLOCK_D, BLOCK_N, True, CAUSAL, True, DOT_PREC, True, HAS_WINDOW)
    if HAS_SINKS:
        acc, l_i, m_i = add_sink(acc, l_i, m_i, tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))  # +inf: P = 0 in the backward
    row_ok = offs_m < Lq
    if (start_m + 1) * BLOCK_M <= Lq:
        desc_o.store([q_start + start_m * BLOCK_M, h * BLOCK_D], o)
    else:  # the sequence's last tile: a descriptor store would write into the next sequence
        offs_d = tl.arange(0, BLOCK_D)
        o_ptrs = O + (q_start + offs_m[:, None]).to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o, mask=row_ok[:, None])
    tl.store(LSE + h * stride_lh + q_start + offs_m, lse, mask=row_ok)


@triton.jit
def _store_rows(desc, ptr, tile, row0, col, n_valid, stride_t, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a [ROWS, BLOCK_D] tile at rows row0.. of the packed tensor: by descriptor when all ROWS rows belong to
    the sequence (n_valid >= ROWS), else with a row mask (the descriptor would spill into the next sequence)."""
    if n_valid >= ROWS:
        desc.store([row0, col], tile)
    else:
        rows = tl.arange(0, ROWS)
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = ptr + (row0 + rows[:, None]).to(tl.int64) * stride_t + col + offs_d[None, :]
        tl.store(ptrs, tile, mask=rows[:, None] < n_valid)


@triton.jit
def _store_kv_grads(desc_dk, desc_dv, DK, DV, dk, dv, k_start, start_n, Lk, col, sm_scale, stride_dkt,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dK (times sm_scale) and dV of key tile start_n; its rows past Lk (another sequence's) are not stored."""
    n_valid = Lk - start_n * BLOCK_N
    row0 = k_start + start_n * BLOCK_N
    _store_rows(desc_dk, DK, (dk * sm_scale).to(DK.dtype.element_ty), row0, col, n_valid, stride_dkt, BLOCK_N, BLOCK_D)
    _store_rows(desc_dv, DV, dv.to(DV.dtype.element_ty), row0, col, n_valid, stride_dkt, BLOCK_N, BLOCK_D)


@triton.jit
def _merged_dkdv_phase(desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, DK, DV, LSE, DELTA, t, hk, k_start, Lk,
                       q_start, Lq, qk_scale, sm_scale, stride_dkt, stride_lh, GROUP, WINDOW, BLOCK_D: tl.constexpr,
                       CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_WINDOW: tl.constexpr):
    """The merged backward's phase 1: the dK/dV program for key tile t (nothing past Lk). One program per (key tile,
    sequence, KV head): K/V tile resident, dK/dV in fp32 registers, Q/dO streamed by TMA for every query head of the
    GQA group; query blocks above the diagonal are skipped, the band masked. Key rows past Lk (the next sequence's)
    only touch their own dK/dV rows, which are not stored."""
    if t * BLOCK_N < Lk:
        diag = Lk - Lq
        offs_m = tl.arange(0, BLOCK_M)
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k = desc_k.load([k_start + t * BLOCK_N, hk * BLOCK_D])
        v = desc_v.load([k_start + t * BLOCK_N, hk * BLOCK_D])
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        m_lo, a1, end = q_bounds(t, Lq, diag, BLOCK_M, BLOCK_N, CAUSAL)
        u = end
        if HAS_WINDOW:  # as the pointer kernel: [u, end) the window's masked edge, later blocks skipped
            u, end = q_window_bounds(t, diag, a1, end, WINDOW, BLOCK_M, BLOCK_N)
        for g in range(GROUP):
            h = hk * GROUP + g
            lse_ptr = LSE + h * stride_lh + q_start
            delta_ptr = DELTA + h * stride_lh + q_start
            dk, dv = kv_inner(dk, dv, k, v, desc_q, desc_do, lse_ptr, delta_ptr, 0, 0, q_start, h * BLOCK_D, offs_m,
                              cols, 0, m_lo, a1, Lq, Lk, diag, qk_scale, WINDOW, BLOCK_D, BLOCK_M, True, CAUSAL,
                              DOT_PREC, True, True, HAS_WINDOW)
            dk, dv = kv_inner(dk, dv, k, v, desc_q, desc_do, lse_ptr, delta_ptr, 0, 0, q_start, h * BLOCK_D, offs_m,
                              cols, 0, a1, u, Lq, Lk, diag, qk_scale, WINDOW, BLOCK_D, BLOCK_M, True, False, DOT_PREC,
                              True, True, False)
            if HAS_WINDOW:
                dk, dv = kv_inner(dk, dv, k, v, desc_q, desc_do, lse_ptr, delta_ptr, 0, 0, q_start, h * BLOCK_D,
                                  offs_m, cols, 0, u, end, Lq, Lk, diag, qk_scale, WINDOW, BLOCK_D, BLOCK_M, True,
                                  False, DOT_PREC, True, True, True)
        _store_kv_grads(desc_dk, desc_dv, DK, DV, dk, dv, k_start, t, Lk, hk * BLOCK_D, sm_scale, stride_dkt,
                        BLOCK_N, BLOCK_D)


@triton.jit
def _merged_dq_phase(desc_q, desc_k, desc_v, desc_do, desc_dq, DQ, LSE, DELTA, t, hk, k_start, Lk, q_start, Lq,
                     qk_scale, sm_scale, stride_dqt, stride_lh, GROUP, WINDOW, BLOCK_D: tl.constexpr,
                     CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_WINDOW: tl.constexpr):
    """The merged backward's phase 2: the dQ kernel's program for query tile t (nothing past Lq), once per query
    head h = hk * GROUP + g of the group."""
    if t * BLOCK_M < Lq:
        diag = Lk - Lq
        offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        row_ok = offs_m < Lq
        hi, full = kv_bounds(t, Lk, diag, BLOCK_M, BLOCK_N, CAUSAL)
        lo = 0
        lo_full = 0
        if HAS_WINDOW:  # as the pointer kernel: blocks left of the window skipped, its left edge masked
            lo, lo_full = kv_window_bounds(t, diag, full, WINDOW, BLOCK_M, BLOCK_N)
        for g in range(GROUP):
            h = hk * GROUP + g
            q = desc_q.load([q_start + t * BLOCK_M, h * BLOCK_D])
            do = desc_do.load([q_start + t * BLOCK_M, h * BLOCK_D])
            lse = tl.load(LSE + h * stride_lh + q_start + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + h * stride_lh + q_start + offs_m, mask=row_ok, other=0.0)
            dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            if HAS_WINDOW:
                dq = dq_inner(dq, q, do, lse, delta, desc_k, desc_v, 0, 0, k_start, hk * BLOCK_D, offs_m, offs_n, 0,
                              lo, lo_full, diag, Lk, qk_scale, WINDOW, BLOCK_D, BLOCK_N, True, CAUSAL, True, DOT_PREC,
                              True, True)
            dq = dq_inner(dq, q, do, lse, delta, desc_k, desc_v, 0, 0, k_start, hk * BLOCK_D, offs_m, offs_n, 0,
                          lo_full, full, diag, Lk, qk_scale, WINDOW, BLOCK_D, BLOCK_N, True, CAUSAL, False, DOT_PREC,
                          True, False)
            dq = dq_inner(dq, q, do, lse, delta, desc_k, desc_v, 0, 0, k_start, hk * BLOCK_D, offs_m, offs_n, 0,
                          full, hi, diag, Lk, qk_scale, WINDOW, BLOCK_D, BLOCK_N, True, CAUSAL, True, DOT_PREC, True,
                          HAS_WINDOW)
            _store_rows(desc_dq, DQ, (dq * sm_scale).to(DQ.dtype.element_ty), q_start + t * BLOCK_M, h * BLOCK_D,
                        Lq - t * BLOCK_M, stride_dqt, BLOCK_M, BLOCK_D)


@triton.jit(do_not_specialize=["stride_lh"])
def _attn_bwd_merged_tma_kernel(
    desc_q1, desc_k1, desc_v1, desc_do1, desc_dk1, desc_dv1, desc_q2, desc_k2, desc_v2, desc_do2, desc_dq2,
    DQ, DK, DV, LSE, DELTA, CU_Q, CU_K, qk_scale, sm_scale, stride_dqt, stride_dkt, stride_lh, GROUP, SEQ_BUCKET,
    WINDOW,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    DQ_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    # The split pair in one launch: program (t, b, hk) runs the dK/dV kernel's key tile t (phase 1, BLOCK_M1 query
    # steps over a BLOCK_N1 key tile) and the dQ kernel's query tile t (phase 2, BLOCK_M2 == BLOCK_N1 rows, BLOCK_N2
    # key steps) for each query head of the group. Causal with Lq == Lk, key tile t's work falls with t as query
    # tile t's grows, so every program does about the same work. Each phase skips a tile past its own sequence's end
    # (Lk > Lq: phase 1 has more tiles). The phases are independent (disjoint outputs), so their order is free:
    # DQ_FIRST runs phase 2 first, which keeps phase 2's values (its descriptor addresses, DQ) from being live across
    # phase 1's register-bound loop (sm_90 ptxas, d128 64 x 64 / 4 warps: 120 bytes of stack instead of 184).
    t, b, hk, k_start, Lk = key_tile(CU_K)
    q_start, Lq = seq_span(CU_Q, b)
    if DQ_FIRST:
        _merged_dq_phase(desc_q2, desc_k2, desc_v2, desc_do2, desc_dq2, DQ, LSE, DELTA, t, hk, k_start, Lk, q_start,
                         Lq, qk_scale, sm_scale, stride_dqt, stride_lh, GROUP, WINDOW, BLOCK_D, CAUSAL, DOT_PREC,
                         BLOCK_M2, BLOCK_N2, HAS_WINDOW)
    _merged_dkdv_phase(desc_q1, desc_k1, desc_v1, desc_do1, desc_dk1, desc_dv1, DK, DV, LSE, DELTA, t, hk, k_start,
                       Lk, q_start, Lq, qk_scale, sm_scale, stride_dkt, stride_lh, GROUP, WINDOW, BLOCK_D, CAUSAL,
                       DOT_PREC, BLOCK_M1, BLOCK_N1, HAS_WINDOW)
    if not DQ_FIRST:
        _merged_dq_phase(desc_q2, desc_k2, desc_v2, desc_do2, desc_dq2, DQ, LSE, DELTA, t, hk, k_start, Lk, q_start,
                         Lq, qk_scale, sm_scale, stride_dqt, stride_lh, GROUP, WINDOW, BLOCK_D, CAUSAL, DOT_PREC,
                         BLOCK_M2, BLOCK_N2, HAS_WINDOW)


def _cfg(bm, bn, warps, stages, maxnreg=None):
    return tile_config(bm, bn, warps, stages, pre_hook=fit_descriptors, maxnreg=maxnreg)


def check_merged_blocks(blocks: dict) -> None:
    """The merged backward's phase-2 query tile must have the phase-1 key tile's rows (the grid and the balance of
    work per program rest on it)."""
    if blocks["BLOCK_M2"] != blocks["BLOCK_N1"]:
        raise ValueError(f"bwd_merged_tma needs BLOCK_M2 == BLOCK_N1, got {blocks}")


def _mcfg(bm1, bn1, bm2, bn2, warps, stages, dq_first=True, maxnreg=None):
    """A merged-backward candidate: phase 1 (dK/dV) BLOCK_M1 x BLOCK_N1, phase 2 (dQ) BLOCK_M2 x BLOCK_N2, the dQ
    phase first unless ``dq_first`` is False."""
    blocks = {"BLOCK_M1": bm1, "BLOCK_N1": bn1, "BLOCK_M2": bm2, "BLOCK_N2": bn2, "DQ_FIRST": dq_first}
    check_merged_blocks(blocks)
    return triton.Config(blocks, num_warps=warps, num_stages=stages, pre_hook=fit_descriptors, maxnreg=maxnreg)


# Candidates per kernel and head dim, sm_90. The d128 forward list comes from a measured sweep (H200, K1 at 4k,
# ``python bench/attention.py --variants --seqs 4096 --sweep wide``): 64 x 64 / 4 warps / 3 stages 1.19 ms,
# 128 x 128 / 8 / 3 1.23. The rest were checked by compiling offline (ptxas, bf16, triton 3.7.1; the device may run
# another triton): every one fits shared memory. Without address tensors the forward's 128 x 64 d128 tile needs 142
# registers and no stack (its pointer twin: 255 and 440 bytes).
CONFIGS = {
    ("fwd_tma", 64): [_cfg(128, 64, 4, 3), _cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3)],
    ("fwd_tma", 128): [_cfg(64, 64, 4, 3), _cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 2),
                       _cfg(128, 64, 4, 3)],
    ("fwd_tma", 256): [_cfg(64, 64, 4, 2), _cfg(128, 64, 8, 2), _cfg(128, 32, 8, 2), _cfg(64, 32, 4, 2)],
    # merged (BLOCK_M1, BLOCK_N1, BLOCK_M2 == BLOCK_N1, BLOCK_N2, warps, stages, dQ phase first unless False): the
    # swept dK/dV tiles of the two-launch TMA pair (d128: 64 x 64 / 4 / 2 2.19 ms, its best; 64 x 128 / 8 / 2 2.73;
    # the dK/dV accumulators bound the tile: 16 x 128 no stack, 64 x 128 120-170 bytes) with a dQ phase of as many
    # query rows. Compiled offline (sm_90, bf16, triton 3.7.1), stacks: d64 none; d128 120, 88, 0, 0, 144, 0 bytes in
    # this order (the other phase order: 184, 200, 16, 8, 216, 16; 32 x 128 / 128 x 32 on 4 warps: 856, left out);
    # d256 0, 56. Shared memory <= 160 KB.
    ("bwd_merged_tma", 64): [_mcfg(64, 64, 64, 64, 4, 2), _mcfg(64, 64, 64, 64, 4, 3), _mcfg(32, 128, 128, 64, 8, 3),
                             _mcfg(64, 128, 128, 64, 8, 2), _mcfg(32, 64, 64, 64, 4, 3),
                             _mcfg(64, 128, 128, 128, 8, 2)],
    ("bwd_merged_tma", 128): [_mcfg(64, 64, 64, 64, 4, 2), _mcfg(64, 64, 64, 64, 4, 3), _mcfg(32, 128, 128, 32, 8, 3),
                              _mcfg(32, 128, 128, 64, 8, 2, dq_first=False), _mcfg(64, 128, 128, 64, 8, 2),
                              _mcfg(32, 64, 64, 32, 4, 3)],
    ("bwd_merged_tma", 256): [_mcfg(16, 64, 64, 32, 8, 2), _mcfg(32, 64, 64, 32, 8, 2)],
}
KERNELS = {"fwd_tma": _attn_fwd_tma_kernel, "bwd_merged_tma": _attn_bwd_merged_tma_kernel}
