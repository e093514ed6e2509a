"""Grouped-GEMM Triton kernels for routed experts, over (token, slot) pairs sorted by expert.

Layout (built in moe.py): ``order`` int32 [M] lists the M = T*k pair ids p = t*k + j sorted (stably) by expert, and
``counts`` int32 [E] says how many pairs each expert got. "Sorted row" r is a position in ``order``; expert e owns
rows [start_e, start_e + counts_e). Each expert's rows are cut into BLOCK_M blocks; a program finds its block's expert
from ``counts`` alone (a cumsum over E in registers), so the block layout needs no host sync, no padding buffer and no
block table, and every kernel's autotuner may pick its own BLOCK_M. The grid is sized for the worst case,
cdiv(M, BLOCK_M) + min(E, M) blocks; blocks past the end return at once. Experts with no pairs own no block.

Kernels (I = intermediate, H = hidden; the FLOP count each one does):
- ``_gate_up_kernel``: g|u = x[tok(r)] @ w13[e]^T with two accumulators (gate rows, up rows) over one I-tile, then
  h = silu(g) * u fused in the epilogue; writes h [M, I] and, when training, g|u [M, 2I].    2*M*H*2I
- ``_expert_rows_kernel``: out[row] = (w_pair *) a[row'] @ B_e, with B_e any strided [K, N] view of an expert's
  weight, a's rows read by token (gathered) or by sorted row, out written by pair or by sorted row. Used for the down
  projection (a = h, B_e = w2[e]^T, scaled by the routing weight, out by pair)  2*M*I*H, dh = dy[tok] @ w2[e] (out
  by sorted row)  2*M*H*I, and dx per pair (a = dg|du, B_e = w13[e])  2*M*2I*H.
- ``_swiglu_routed_bwd_kernel`` (elementwise, per sorted row): from dh, g|u and the routing weight w: dg|du of
  w * silu(g) * u, the row's w*h (for dW2) and d w = <dh, h> reduced over the whole row (deterministic). Kept out of
  the dh GEMM's epilogue: fused there it needed 255 registers and spilled on sm_90 at every tile shape tried.
- ``_expert_weight_grad_kernel``: dW[e] = sum over e's rows of a_row^T b_row, one [P, Q] tile per program, looping
  over the rows: dW2 = dy^T (w*h) and dW13 = (dg|du)^T x. Empty experts write zeros.  2*M*H*I and 2*M*2I*H
Forward 6*M*H*I FLOPs, backward 12*M*H*I.

All GEMMs accumulate in fp32 (tl.dot, IEEE for fp32 inputs). Row/pair/expert offsets are int64.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import autotune_candidates, interpreting


@triton.jit
def _expert_block(counts_ptr, pid_m, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first sorted row, rows left in the expert from there) for M-block ``pid_m``; expert >= E: no block."""
    offs_e = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    nblk = (cnt + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, 0)
    row_end = tl.cumsum(cnt, 0)
    expert = tl.sum((blk_end <= pid_m).to(tl.int32), 0)
    sel = offs_e == expert
    local = pid_m - tl.sum(tl.where(sel, blk_end - nblk, 0), 0)
    row0 = tl.sum(tl.where(sel, row_end - cnt, 0), 0) + local * BLOCK_M
    left = tl.sum(tl.where(sel, cnt, 0), 0) - local * BLOCK_M
    valid = expert < E
    return expert, tl.where(valid, row0, 0), tl.where(valid, left, 0)  # no block: row 0, nothing to do


@triton.jit
def _wrap(offs, n, EVEN: tl.constexpr):
    """Column offsets kept in bounds so loads need no mask (the store masks); plain when the tile divides n,
    which keeps the compiler's contiguity facts for vector loads."""
    if EVEN:
        return offs
    else:
        return offs % n


@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks sweep all column tiles together, so their A rows stay in L2."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def block_rows(order_ptr, counts_ptr, M, num_n, E, TOP_K,
                BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (expert, column tile, sorted rows int64 [BLOCK_M], their pair ids, their token ids, row mask);
    expert >= E: no block (return at once). Shared with the FP8 grouped GEMMs (moe/fp8.py)."""
    num_m = tl.cdiv(M, BLOCK_M) + tl.minimum(E, M)  # worst case: every used expert ends in a partial block
    pid_m, pid_n = _tile(tl.program_id(0), num_m, num_n, GROUP_M)
    expert, row0, left = _expert_block(counts_ptr, pid_m, E, BLOCK_M, BLOCK_E)
    offs = tl.arange(0, BLOCK_M)
    mask_m = offs < left
    rows = tl.where(mask_m, row0 + offs, row0).to(tl.int64)  # rows past the block reread row0: no load masks
    pair = tl.load(order_ptr + rows).to(tl.int64)
    return expert, pid_n, rows, pair, pair // TOP_K, mask_m


@triton.jit(do_not_specialize=["M", "tune_m"])
def _gate_up_kernel(x_ptr, w_ptr, order_ptr, counts_ptr, h_ptr, gu_ptr,
                    M, E, N, K, TOP_K, stride_xm, stride_we, stride_wn, tune_m,
                    SAVE_GU: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PREC: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):
    # N = I, K = H; w13[e] is [2N, K]: gate rows [0, N), up rows [N, 2N)
    expert, pid_n, rows, pair, tok, mask_m = block_rows(
        order_ptr, counts_ptr, M, tl.cdiv(N, BLOCK_N), E, TOP_K, BLOCK_M, BLOCK_E, GROUP_M)
    if expert >= E:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nw = _wrap(offs_n, N, EVEN_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            bg = tl.load(g_ptrs)
            bu = tl.load(u_ptrs)
        else:
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dt = h_ptr.dtype.element_ty
    g = acc_g.to(dt)
    u = acc_u.to(dt)
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    if SAVE_GU:
        gu_ptrs = gu_ptr + rows[:, None] * (2 * N) + offs_n[None, :]
        tl.store(gu_ptrs, g, mask=mask)
        tl.store(gu_ptrs + N, u, mask=mask)
    gf = g.to(tl.float32)
    act = (gf * tl.sigmoid(gf)).to(dt).to(tl.float32)  # rounded like transformers' act_fn output
    tl.store(h_ptr + rows[:, None] * N + offs_n[None, :], (act * u.to(tl.float32)).to(dt), mask=mask)


@triton.jit(do_not_specialize=["M", "tune_m"])
def _expert_rows_kernel(a_ptr, w_ptr, order_ptr, counts_ptr, scale_ptr, out_ptr,
                        M, E, N, K, TOP_K, stride_am, stride_we, stride_wk, stride_wn, tune_m,
                        GATHER_A: tl.constexpr, OUT_SORTED: tl.constexpr, SCALE: tl.constexpr,
                        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PREC: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):
    # out[(r or pair(r)), :N] = (scale[pair] *) a[(tok(r) or r), :K] @ B_e;  out is [M, N] contiguous
    expert, pid_n, rows, pair, tok, mask_m = block_rows(
        order_ptr, counts_ptr, M, tl.cdiv(N, BLOCK_N), E, TOP_K, BLOCK_M, BLOCK_E, GROUP_M)
    if expert >= E:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nw = _wrap(offs_n, N, EVEN_N)
    offs_k = tl.arange(0, BLOCK_K)
    if GATHER_A:
        a_ptrs = a_ptr + tok[:, None] * stride_am + offs_k[None, :]
    else:
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    if SCALE:
        acc = acc * tl.load(scale_ptr + pair).to(tl.float32)[:, None]
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    if OUT_SORTED:
        out_ptrs = out_ptr + rows[:, None] * N + offs_n[None, :]
    else:
        out_ptrs = out_ptr + pair[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _swiglu_routed_bwd_kernel(dh_ptr, gu_ptr, order_ptr, topk_w_ptr, dgu_ptr, hw_ptr, dw_ptr, M, N,
                              BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # per sorted row r (pair p = order[r], routing weight w = w[p]), with h = silu(g) * u as the forward rounded it:
    #   d w[p] = <dh, h>;  d(w h) = w dh  ->  du = w dh silu(g),  dg = w dh u silu'(g);  hw = w h
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < M
    rows = tl.where(mask_r, rows, 0).to(tl.int64)
    pair = tl.load(order_ptr + rows).to(tl.int64)
    w = tl.load(topk_w_ptr + pair).to(tl.float32)[:, None]
    dt = dgu_ptr.dtype.element_ty
    dw = tl.zeros([BLOCK_R], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask = mask_r[:, None] & (offs_n < N)[None, :]
        dh = tl.load(dh_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        gu = rows[:, None] * (2 * N) + offs_n[None, :]
        g = tl.load(gu_ptr + gu, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + gu + N, mask=mask, other=0.0).to(tl.float32)
        sg = tl.sigmoid(g)
        act = (g * sg).to(dt).to(tl.float32)
        h = (act * u).to(dt).to(tl.float32)
        dw += tl.sum(dh * h, axis=1)
        dh = dh * w
        tl.store(dgu_ptr + gu, (dh * u * sg * (1.0 + g * (1.0 - sg))).to(dt), mask=mask)
        tl.store(dgu_ptr + gu + N, (dh * act).to(dt), mask=mask)
        tl.store(hw_ptr + rows[:, None] * N + offs_n[None, :], (h * w).to(dt), mask=mask)
    tl.store(dw_ptr + pair, dw, mask=mask_r)


@triton.jit(do_not_specialize=["tune_m"])
def _expert_weight_grad_kernel(a_ptr, b_ptr, order_ptr, counts_ptr, out_ptr, E, P, Q, TOP_K, tune_m,
                               GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, EVEN_P: tl.constexpr,
                               EVEN_Q: tl.constexpr, DOT_PREC: tl.constexpr,
                               BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_E: tl.constexpr):
    # out[e] [P, Q] = sum over e's sorted rows r of a_row(r)^T b_row(r); a_row(r) = a[tok(r)] (GATHER_A) or a[r],
    # a is [*, P] and b is [*, Q], both contiguous. One program per (expert, P-tile, Q-tile), experts outermost.
    pid = tl.program_id(0)
    tiles_q = tl.cdiv(Q, BLOCK_Q)
    per_e = tl.cdiv(P, BLOCK_P) * tiles_q
    expert = pid // per_e
    pid_p = (pid % per_e) // tiles_q
    pid_q = pid % tiles_q
    offs_e = tl.arange(0, BLOCK_E)
    cnt_all = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    start = tl.sum(tl.where(offs_e < expert, cnt_all, 0), 0)
    cnt = tl.sum(tl.where(offs_e == expert, cnt_all, 0), 0)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_pw = _wrap(offs_p, P, EVEN_P)
    offs_qw = _wrap(offs_q, Q, EVEN_Q)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    for r0 in range(0, cnt, BLOCK_R):
        r_ok = offs_r < cnt - r0
        rows = (start + r0 + tl.where(r_ok, offs_r, 0)).to(tl.int64)
        if GATHER_A or GATHER_B:
            tok = tl.load(order_ptr + rows).to(tl.int64) // TOP_K
        ra = tok if GATHER_A else rows
        rb = tok if GATHER_B else rows
        a = tl.load(a_ptr + ra[None, :] * P + offs_pw[:, None], mask=r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rb[:, None] * Q + offs_qw[None, :], mask=r_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    mask = (offs_p < P)[:, None] & (offs_q < Q)[None, :]
    out_ptrs = out_ptr + expert.to(tl.int64) * P * Q + offs_p[:, None] * Q + offs_q[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launch configurations. Under the interpreter: one small config. Decode-size batches (at most 16 pairs per expert
# on average): a fixed BLOCK_M=16 config, no autotuning, so the rollout engine can capture it in a CUDA graph.
# Otherwise autotuned on CUDA (Hopper: wgmma tiles of 64-128 x 64-256, BLOCK_K 64, 3-4 stages), keyed on the
# problem's N, K and a power-of-two bucket of pairs per expert, so a training run tunes once per shape.

def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


def _wcfg(bp, bq, br, warps, stages):
    return triton.Config({"BLOCK_P": bp, "BLOCK_Q": bq, "BLOCK_R": br}, num_warps=warps, num_stages=stages)


_GATE_UP_CONFIGS = [  # two BLOCK_M x BLOCK_N accumulators (gate, up) per program
    _cfg(64, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 3), _cfg(128, 64, 64, 4, 4), _cfg(128, 64, 64, 8, 4),
    _cfg(128, 128, 64, 8, 3), _cfg(64, 64, 128, 4, 3),
]
_ROWS_CONFIGS = [
    _cfg(64, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 4), _cfg(128, 64, 64, 4, 4), _cfg(128, 128, 64, 8, 3),
    _cfg(128, 256, 64, 8, 3), _cfg(64, 128, 128, 4, 3),
]
_WGRAD_CONFIGS = [
    _wcfg(128, 128, 64, 8, 3), _wcfg(128, 128, 64, 4, 3), _wcfg(64, 128, 64, 4, 4), _wcfg(128, 256, 64, 8, 3),
    _wcfg(128, 64, 64, 4, 4),
]
_INTERP = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
_INTERP_WGRAD = dict(BLOCK_P=32, BLOCK_Q=32, BLOCK_R=16, num_warps=4, num_stages=1)
# decode: weight-bandwidth bound; narrow N tiles put more programs (SMs) on the few experts a small batch touches
_DECODE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
_DECODE_GATE_UP = dict(_DECODE, BLOCK_N=32)


def _decode_config(base: dict, dtype: torch.dtype) -> dict:
    return dict(base, BLOCK_K=64, num_stages=3) if dtype == torch.float32 else base  # fp32: same shared memory


def _fast_bench(fn, quantiles=None, **_):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _autotune(configs, key, **kwargs):
    if "do_bench" in inspect.signature(triton.autotune).parameters:
        kwargs["do_bench"] = _fast_bench
    return triton.autotune(configs=autotune_candidates(configs), key=key, **kwargs)


_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                             "EVEN_N": lambda args: args["N"] % args["BLOCK_N"] == 0})
_even_pq = triton.heuristics({"EVEN_P": lambda args: args["P"] % args["BLOCK_P"] == 0,
                              "EVEN_Q": lambda args: args["Q"] % args["BLOCK_Q"] == 0})
_gate_up = _even_k(_gate_up_kernel)
_rows = _even_k(_expert_rows_kernel)
_wgrad = _even_pq(_expert_weight_grad_kernel)
gate_up_tuned = _autotune(_GATE_UP_CONFIGS, ["N", "K", "tune_m", "SAVE_GU"])(_gate_up)
rows_tuned = _autotune(_ROWS_CONFIGS, ["N", "K", "tune_m", "stride_wk", "GATHER_A", "OUT_SORTED", "SCALE"])(_rows)
wgrad_tuned = _autotune(_WGRAD_CONFIGS, ["P", "Q", "tune_m", "GATHER_A"])(_wgrad)


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is the default and means nothing for 16-bit inputs


def _tune_m(M: int, E: int) -> int:
    return triton.next_power_of_2(max(1, M // E))


def _launch_rows(kernel, tuned, M, E, N, args, consts, decode=_DECODE):
    """Row-block kernel: fixed config under the interpreter or at decode size, autotuned otherwise."""
    grid = lambda meta: ((triton.cdiv(M, meta["BLOCK_M"]) + min(E, M)) * triton.cdiv(N, meta["BLOCK_N"]),)
    consts = dict(consts, DOT_PREC=_dot_prec(args[0].dtype), BLOCK_E=triton.next_power_of_2(E))
    fixed = _INTERP if interpreting() else (_decode_config(decode, args[0].dtype) if M <= 16 * E else None)
    if fixed is None:
        tuned[grid](*args, **consts)
    else:
        kernel[grid](*args, **consts, **fixed)


def gate_up(x, w13, order, counts, top_k: int, save_gu: bool):
    """Sorted-row h = silu(x W_g^T) * (x W_u^T) [M, I], and g|u [M, 2I] when ``save_gu`` (else None)."""
    M, E, I2, H = order.numel(), counts.numel(), w13.shape[1], w13.shape[2]
    I = I2 // 2
    h = torch.empty(M, I, dtype=x.dtype, device=x.device)
    gu = torch.empty(M, I2, dtype=x.dtype, device=x.device) if save_gu else h
    args = (x, w13, order, counts, h, gu, M, E, I, H, top_k, x.stride(0), w13.stride(0), w13.stride(1),
            _tune_m(M, E))
    _launch_rows(_gate_up, gate_up_tuned, M, E, I, args, dict(SAVE_GU=save_gu), decode=_DECODE_GATE_UP)
    return h, (gu if save_gu else None)


def expert_rows(a, w, w_strides, N: int, order, counts, top_k: int, *, scale=None, gather_a=False, out_sorted=False):
    """[M, N]: row (pair, or sorted row if ``out_sorted``) = (scale[pair] *) a_row @ B_e, a_row = a[tok] if
    ``gather_a`` else a[sorted row], B_e the [K, N] view of w[e] with (expert, k, n) strides ``w_strides``."""
    K, M, E = a.shape[1], order.numel(), counts.numel()
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    args = (a, w, order, counts, a if scale is None else scale, out, M, E, N, K, top_k, a.stride(0), *w_strides,
            _tune_m(M, E))
    consts = dict(GATHER_A=gather_a, OUT_SORTED=out_sorted, SCALE=scale is not None)
    _launch_rows(_rows, rows_tuned, M, E, N, args, consts)
    return out


def down_grad(dy, w2, order, counts, gu, topk_w, top_k: int):
    """(dg|du [M, 2I] and w*h [M, I] by sorted row, d topk_weights fp32 [M] by pair) from dy [T, H]."""
    M, I = order.numel(), w2.shape[2]
    # dh = dy[tok] @ w2[e]: B_e = w2[e] is [K=H, N=I] row-major -> strides (H*I, I, 1)
    dh = expert_rows(dy, w2, (w2.stride(0), w2.stride(1), 1), I, order, counts, top_k, gather_a=True,
                     out_sorted=True)
    dgu = torch.empty(M, 2 * I, dtype=dy.dtype, device=dy.device)
    hw = torch.empty(M, I, dtype=dy.dtype, device=dy.device)
    dw = torch.empty(M, dtype=torch.float32, device=dy.device)
    block_r = 8
    _swiglu_routed_bwd_kernel[(triton.cdiv(M, block_r),)](
        dh, gu, order, topk_w, dgu, hw, dw, M, I, BLOCK_R=block_r, BLOCK_N=min(triton.next_power_of_2(I), 256),
        num_warps=4)
    return dgu, hw, dw


def expert_weight_grad(a, b, order, counts, top_k: int, gather_a: bool, gather_b: bool):
    """[E, P, Q]: per expert, the sum over its sorted rows of a_row^T b_row (rows gathered by token or direct)."""
    P, Q, E, M = a.shape[1], b.shape[1], counts.numel(), order.numel()
    out = torch.empty(E, P, Q, dtype=a.dtype, device=a.device)
    args = (a, b, order, counts, out, E, P, Q, top_k, _tune_m(M, E))
    consts = dict(GATHER_A=gather_a, GATHER_B=gather_b, DOT_PREC=_dot_prec(a.dtype),
                  BLOCK_E=triton.next_power_of_2(E))
    grid = lambda meta: (E * triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(Q, meta["BLOCK_Q"]),)
    if interpreting():
        _wgrad[grid](*args, **consts, **_INTERP_WGRAD)
    else:
        wgrad_tuned[grid](*args, **consts)
    return out
