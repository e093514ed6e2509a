"""The attention prologue of a decoder layer on the training path, fused: per-head QK RMSNorm and RoPE, with autograd.

Input: the fused projection ``qkv [T, (Hq + 2 * Hkv) * D]`` = ``[q heads | k heads | v heads]`` (any row stride).
For every query head (norm weight ``wq``) and key head (``wk``), the norms optional (both None: RoPE only):

    n  = x / sqrt(mean(x^2) + eps)       (fp32, mean over D)
    x' = (w * n.to(dtype)).to(dtype)     (rms_norm's rounding: the normed value is in qkv's dtype before RoPE)
    y  = rope(x')                        (NeoX rotate-halves on the first rotary_dim dims, fp32, rounded once)

Returns ``q = y_q [T, Hq, D]`` and ``k = y_k [T, Hkv, D]`` (new tensors) and ``v [T, Hkv, D]``, a view of qkv's v
columns. The math and rounding order are those of ``qkv_prologue`` (the inference kernel) and of ``rms_norm`` ->
``apply_rope`` (the native reference below composes exactly those), so outputs equal the unfused chain but for rare
one-ulp flips from the fp32 order of the sum of squares.

Backward, per q/k head row, with ``dy`` the output's gradient (fp32 throughout, rounded once at the store):

    da  = rope^T(dy)                     (the rotation by -theta; the dims past rotary_dim pass through)
    dw += da * n.to(dtype)               (over all rows: one fp32 partial row per program, then one sum)
    dx  = rstd * (da * w - n * mean(da * w * n))

and ``dv`` is copied into the v columns, so one launch writes the whole ``dqkv [T, width]`` (the split's backward,
a concat, is gone). Unlike the unfused chain, ``da`` is not rounded to the dtype between the RoPE and the norm
backward. Saved for the backward: qkv (alive anyway: v is a view of it) and the fp32 rstd per (token, q/k head).

Tiling: the q and k heads of a token are adjacent in qkv, so its ``T * (Hq + Hkv)`` head rows form one row space
(row r: token r // (Hq + Hkv), head r % (Hq + Hkv); heads below Hq are queries: weight wq, output q; the rest keys).
Forward: one program per BLOCK_R rows, each row as two [D/2] halves (plus the dims past rotary_dim), its cos/sin
row gathered by the token's position. Backward: a persistent grid (a few programs per SM) strides over the same
row tiles, accumulating both weights' gradients in registers, then over [BLOCK_RV, D] tiles of v rows.

Bytes per token, E = element size, Hqk = Hq + Hkv:
- forward: read and write Hqk D (+ 4 Hqk for rstd): 2 Hqk D E, against 4 Hqk D E for norm -> rope unfused;
- backward: read dq, dk and x, write dx: 3 Hqk D E, plus dv read and written: 2 Hkv D E; unfused, the two RoPE
  backwards (2 Hqk D E), the two norm backwards (3 Hqk D E) and the concat (2 (Hqk + Hkv) D E) move 7 Hqk D E + 2 Hkv
  D E. With Hq=16, Hkv=8, D=128 in bf16: 12.4 KB + 22.6 KB per token against 24.6 KB + 47.1 KB; 0.57 GB against
  1.17 GB per layer at T=16384.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from areno.kernels._device import sm_count
from areno.kernels.attention.prologue import check_prologue_inputs
from areno.kernels.dispatch import autotune_candidates, interpreting, use_triton
from areno.kernels.norm import rms_norm_native, sum_rows
from areno.kernels.rope import apply_rope_native

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 512


@triton.jit
def _head_rows(tile, T, HQ, HKV, POS, COS, SIN, scos, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rows of q/k tile ``tile``: (rows, mask, token, head, is_q, cos, sin), cos/sin [BLOCK_R, BLOCK_HALF] fp32."""
    hqk = HQ + HKV
    rows = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < T * hqk
    t = rows // hqk
    h = rows % hqk
    k = tl.arange(0, BLOCK_HALF)
    m = rmask[:, None] & (k < HALF)[None, :]
    pos = tl.load(POS + t, mask=rmask, other=0).to(tl.int64)
    c = tl.load(COS + pos[:, None] * scos + k[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(SIN + pos[:, None] * scos + k[None, :], mask=m, other=0.0).to(tl.float32)
    return rows, rmask, t, h, h < HQ, c, s


@triton.jit
def _row_weights(WQ, WK, is_q, cols, cmask):
    """[rows, cols] fp32: wq on query-head rows, wk on key-head rows."""
    wq = tl.load(WQ + cols, mask=cmask, other=0.0).to(tl.float32)
    wk = tl.load(WK + cols, mask=cmask, other=0.0).to(tl.float32)
    return tl.where(is_q[:, None], wq[None, :], wk[None, :])


@triton.jit
def _qk_norm_rope_fwd_kernel(
    QKV, POS, COS, SIN, WQ, WK, Q, K, RSTD,
    T, HQ, HKV, sxt, scos, eps,
    D: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    dtype = QKV.dtype.element_ty
    rows, rmask, t, h, is_q, c, s = _head_rows(
        tl.program_id(0), T, HQ, HKV, POS, COS, SIN, scos, HALF, BLOCK_R, BLOCK_HALF
    )
    k = tl.arange(0, BLOCK_HALF)
    kmask = k < HALF
    m = rmask[:, None] & kmask[None, :]
    x_at = QKV + (t * sxt + h * D)[:, None]
    x1 = tl.load(x_at + k[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + HALF + k[None, :], mask=m, other=0.0).to(tl.float32)
    if BLOCK_PASS > 0:  # dims past rotary_dim: normed, not rotated
        p = tl.arange(0, BLOCK_PASS)
        pmask = p < D - 2 * HALF
        mp = rmask[:, None] & pmask[None, :]
        xp = tl.load(x_at + 2 * HALF + p[None, :], mask=mp, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if BLOCK_PASS > 0:
            ss += tl.sum(xp * xp, axis=1)
        rstd = tl.rsqrt(ss / D + eps)
        tl.store(RSTD + rows, rstd, mask=rmask)
        w1 = _row_weights(WQ, WK, is_q, k, kmask)
        w2 = _row_weights(WQ + HALF, WK + HALF, is_q, k, kmask)
        x1 = (w1 * (x1 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if BLOCK_PASS > 0:
            wp = _row_weights(WQ + 2 * HALF, WK + 2 * HALF, is_q, p, pmask)
            xp = (wp * (xp * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # q is [T, HQ, D] and k [T, HKV, D], both contiguous; each row goes to one of them
    q_at = Q + ((t * HQ + h) * D)[:, None]
    k_at = K + ((t * HKV + h - HQ) * D)[:, None]
    mq, mk = m & is_q[:, None], m & ~is_q[:, None]
    y1 = (x1 * c - x2 * s).to(dtype)
    y2 = (x2 * c + x1 * s).to(dtype)
    tl.store(q_at + k[None, :], y1, mask=mq)
    tl.store(k_at + k[None, :], y1, mask=mk)
    tl.store(q_at + HALF + k[None, :], y2, mask=mq)
    tl.store(k_at + HALF + k[None, :], y2, mask=mk)
    if BLOCK_PASS > 0:
        tl.store(q_at + 2 * HALF + p[None, :], xp.to(dtype), mask=mp & is_q[:, None])
        tl.store(k_at + 2 * HALF + p[None, :], xp.to(dtype), mask=mp & ~is_q[:, None])


@triton.jit
def _qk_norm_rope_bwd_kernel(
    DQ, DK, DV, QKV, POS, COS, SIN, WQ, WK, RSTD, DQKV, DW_PART,
    T, HQ, HKV, sxt, scos, ROWS_BUCKET,
    D: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_RV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    # DW_PART [2, programs, D] fp32: this program's partial sums of dwq (plane 0) and dwk (plane 1).
    # ROWS_BUCKET: the row count's power of two (the autotuning key only).
    dtype = QKV.dtype.element_ty
    QK_TILES = tl.cdiv(T * (HQ + HKV), BLOCK_R)
    V_TILES = tl.cdiv(T * HKV, BLOCK_RV)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    width = (HQ + 2 * HKV) * D
    k = tl.arange(0, BLOCK_HALF)
    kmask = k < HALF
    p = tl.arange(0, BLOCK_PASS if BLOCK_PASS > 0 else 1)
    pmask = p < D - 2 * HALF
    # dweight partials as [BLOCK_R, cols] register tiles, summed over rows once after the loop (a cross-warp
    # reduction per tile would put a block-wide barrier in every iteration)
    dwq1 = tl.zeros([BLOCK_R, BLOCK_HALF], dtype=tl.float32)
    dwq2 = tl.zeros([BLOCK_R, BLOCK_HALF], dtype=tl.float32)
    dwk1 = tl.zeros([BLOCK_R, BLOCK_HALF], dtype=tl.float32)
    dwk2 = tl.zeros([BLOCK_R, BLOCK_HALF], dtype=tl.float32)
    dwqp = tl.zeros([BLOCK_R, BLOCK_PASS if BLOCK_PASS > 0 else 1], dtype=tl.float32)
    dwkp = tl.zeros([BLOCK_R, BLOCK_PASS if BLOCK_PASS > 0 else 1], dtype=tl.float32)
    for tile in range(pid, QK_TILES, programs):
        rows, rmask, t, h, is_q, c, s = _head_rows(tile, T, HQ, HKV, POS, COS, SIN, scos, HALF, BLOCK_R, BLOCK_HALF)
        m = rmask[:, None] & kmask[None, :]
        mq, mk = m & is_q[:, None], m & ~is_q[:, None]
        dq_at = DQ + ((t * HQ + h) * D)[:, None]
        dk_at = DK + ((t * HKV + h - HQ) * D)[:, None]
        g1 = tl.load(dq_at + k[None, :], mask=mq, other=0.0) + tl.load(dk_at + k[None, :], mask=mk, other=0.0)
        g2 = tl.load(dq_at + HALF + k[None, :], mask=mq, other=0.0) + tl.load(
            dk_at + HALF + k[None, :], mask=mk, other=0.0
        )
        g1, g2 = g1.to(tl.float32), g2.to(tl.float32)
        a1 = g1 * c + g2 * s  # the transpose of the rotation
        a2 = g2 * c - g1 * s
        if BLOCK_PASS > 0:
            mp = rmask[:, None] & pmask[None, :]
            gq = tl.load(dq_at + 2 * HALF + p[None, :], mask=mp & is_q[:, None], other=0.0)
            gk = tl.load(dk_at + 2 * HALF + p[None, :], mask=mp & ~is_q[:, None], other=0.0)
            ap = (gq + gk).to(tl.float32)
        x_at = QKV + (t * sxt + h * D)[:, None]
        if HAS_NORM:
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)[:, None]
            n1 = tl.load(x_at + k[None, :], mask=m, other=0.0).to(tl.float32) * rstd
            n2 = tl.load(x_at + HALF + k[None, :], mask=m, other=0.0).to(tl.float32) * rstd
            if COMPUTE_DW:
                qrow = is_q[:, None]
                d1 = a1 * n1.to(dtype).to(tl.float32)
                d2 = a2 * n2.to(dtype).to(tl.float32)
                dwq1 += tl.where(qrow, d1, 0.0)
                dwk1 += tl.where(qrow, 0.0, d1)
                dwq2 += tl.where(qrow, d2, 0.0)
                dwk2 += tl.where(qrow, 0.0, d2)
            a1 = a1 * _row_weights(WQ, WK, is_q, k, kmask)
            a2 = a2 * _row_weights(WQ + HALF, WK + HALF, is_q, k, kmask)
            dot = tl.sum(a1 * n1, axis=1) + tl.sum(a2 * n2, axis=1)
            if BLOCK_PASS > 0:
                np_ = tl.load(x_at + 2 * HALF + p[None, :], mask=mp, other=0.0).to(tl.float32) * rstd
                if COMPUTE_DW:
                    dp = ap * np_.to(dtype).to(tl.float32)
                    dwqp += tl.where(qrow, dp, 0.0)
                    dwkp += tl.where(qrow, 0.0, dp)
                ap = ap * _row_weights(WQ + 2 * HALF, WK + 2 * HALF, is_q, p, pmask)
                dot += tl.sum(ap * np_, axis=1)
            mean = (dot / D)[:, None]
            a1 = rstd * (a1 - n1 * mean)
            a2 = rstd * (a2 - n2 * mean)
            if BLOCK_PASS > 0:
                ap = rstd * (ap - np_ * mean)
        dx_at = DQKV + (t * width + h * D)[:, None]
        tl.store(dx_at + k[None, :], a1.to(DQKV.dtype.element_ty), mask=m)
        tl.store(dx_at + HALF + k[None, :], a2.to(DQKV.dtype.element_ty), mask=m)
        if BLOCK_PASS > 0:
            tl.store(dx_at + 2 * HALF + p[None, :], ap.to(DQKV.dtype.element_ty), mask=mp)
    # the v columns of dqkv are dv itself
    d = tl.arange(0, BLOCK_D)
    for tile in range(pid, V_TILES, programs):
        rows = (tile * BLOCK_RV + tl.arange(0, BLOCK_RV)).to(tl.int64)
        mv = (rows < T * HKV)[:, None] & (d < D)[None, :]
        t = rows // HKV
        h = rows % HKV
        dv = tl.load(DV + rows[:, None] * D + d[None, :], mask=mv)
        tl.store(DQKV + (t * width + (HQ + HKV + h) * D)[:, None] + d[None, :], dv.to(DQKV.dtype.element_ty), mask=mv)
    if COMPUTE_DW:
        q_part = DW_PART + pid.to(tl.int64) * D
        k_part = q_part + programs.to(tl.int64) * D
        tl.store(q_part + k, tl.sum(dwq1, axis=0), mask=kmask)
        tl.store(q_part + HALF + k, tl.sum(dwq2, axis=0), mask=kmask)
        tl.store(k_part + k, tl.sum(dwk1, axis=0), mask=kmask)
        tl.store(k_part + HALF + k, tl.sum(dwk2, axis=0), mask=kmask)
        if BLOCK_PASS > 0:
            tl.store(q_part + 2 * HALF + p, tl.sum(dwqp, axis=0), mask=pmask)
            tl.store(k_part + 2 * HALF + p, tl.sum(dwkp, axis=0), mask=pmask)


def _tiles(rows: int, width: int, elements: int) -> int:
    """Rows per tile: about ``elements`` elements of rows ``width`` wide (padded), at most rows' next power of 2; a
    power of 2 (``tl.arange``'s rule) also where ``width`` is not one (partial RoPE: two halves of 32 and 192 dims
    past them padded to 256 are 320 wide)."""
    return min(triton.next_power_of_2(max(rows, 1)), _pow2_floor(elements // width))


def _pow2_floor(n: int) -> int:
    """The largest power of 2 <= n (1 for n < 2)."""
    return 1 << (max(n, 1).bit_length() - 1)


# Elements per tile (of padded head rows: two D/2 halves and the dims past rotary_dim) and warps, forward and backward,
# and the backward's programs per SM. On sm_90 with D=128 neither kernel spills (ptxas, bf16: 62 and 96 registers per
# thread); 16 backward programs per SM leave the small tilings enough programs to fill an SM. The interpreter uses
# small tiles so that tiny test shapes span several tiles and the persistent loop runs several times per program.
_FWD_TILE, _FWD_WARPS = 2048, 8
_BWD_TILE, _BWD_WARPS, _BWD_PER_SM = 1024, 4, 16
_INTERPRETER_TILE, _INTERPRETER_PROGRAMS = 128, 3
# On CUDA the backward's tiling is autotuned (elements per tile, warps) over this list at a fixed program count
# (_BWD_PER_SM per SM, sized by the smallest tile), so every candidate writes every partial row of dweight. The
# first measurement (H200, T2's 16,384 tokens x 24 q/k heads, D=128) had the fixed 1024 / 4 warps at 0.38 ms a layer,
# ~1.5 TB/s, where the forward streams at ~3 TB/s.
_BWD_TILES = [(1024, 4), (2048, 8), (2048, 4), (4096, 8), (512, 2), (1024, 2)]


@functools.cache
def _tuned_bwd(width: int, width_v: int):
    """The backward autotuned over _BWD_TILES for head rows ``width`` (padded) and v rows ``width_v`` wide."""
    configs = [triton.Config({"BLOCK_R": _pow2_floor(tile // width), "BLOCK_RV": _pow2_floor(tile // width_v)},
                             num_warps=w) for tile, w in _BWD_TILES]
    return triton.autotune(autotune_candidates(configs), key=["ROWS_BUCKET", "D", "HALF", "HAS_NORM", "COMPUTE_DW"])(
        _qk_norm_rope_bwd_kernel)


def _pow2_bucket(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _pass_block(d: int, half: int) -> int:
    rest = d - 2 * half
    return triton.next_power_of_2(rest) if rest > 0 else 0


def _kernel_layout(qkv, cos, sin):
    """qkv with a unit last stride, cos/sin with unit column strides and one layout (copies only where not)."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return qkv, cos, sin


def qk_norm_rope_fwd(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight, eps):
    """Launch the forward (inputs checked by :func:`qk_norm_rope`). Returns ``(q, k, rstd)``, rstd fp32
    ``[T * (Hq + Hkv)]`` (empty without norm)."""
    qkv, cos, sin = _kernel_layout(qkv, cos, sin)
    t, hq, hkv, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
    has_norm = q_norm_weight is not None
    q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, hkv, d), dtype=qkv.dtype, device=qkv.device)
    rstd = torch.empty(t * (hq + hkv) if has_norm else 0, dtype=torch.float32, device=qkv.device)
    if t == 0:
        return q, k, rstd
    half = cos.shape[1]
    rows = t * (hq + hkv)
    block_half, block_pass = triton.next_power_of_2(half), _pass_block(d, half)
    block_r = _tiles(rows, 2 * block_half + block_pass, _INTERPRETER_TILE if interpreting() else _FWD_TILE)
    _qk_norm_rope_fwd_kernel[(triton.cdiv(rows, block_r),)](
        qkv, positions.contiguous(), cos, sin,
        q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv, q, k, rstd if has_norm else q,
        t, hq, hkv, qkv.stride(0), cos.stride(0), float(eps),
        D=d, HALF=half, HAS_NORM=has_norm, BLOCK_R=block_r, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        num_warps=_FWD_WARPS,
    )  # fmt: skip
    return q, k, rstd


def qk_norm_rope_bwd(dq, dk, dv, qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, q_norm_weight,
                     k_norm_weight, rstd, compute_dweight=True):  # fmt: skip
    """Launch the backward. Returns ``(dqkv [T, width] contiguous, dwq, dwk)`` (the dweights None without norm or
    without ``compute_dweight``)."""
    qkv, cos, sin = _kernel_layout(qkv, cos, sin)
    t, hq, hkv, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
    has_norm = q_norm_weight is not None
    compute_dw = has_norm and compute_dweight
    assert dq.shape == (t, hq, d) and dk.shape == (t, hkv, d) and dv.shape == (t, hkv, d), (
        f"qk_norm_rope backward: gradients {tuple(dq.shape)}, {tuple(dk.shape)}, {tuple(dv.shape)} do not match "
        f"q [{t}, {hq}, {d}], k and v [{t}, {hkv}, {d}]"
    )
    dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
    dqkv = torch.empty((t, (hq + 2 * hkv) * d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        zeros = (torch.zeros_like(q_norm_weight), torch.zeros_like(k_norm_weight)) if compute_dw else (None, None)
        return dqkv, *zeros
    half = cos.shape[1]
    rows = t * (hq + hkv)
    block_half, block_pass, block_d = triton.next_power_of_2(half), _pass_block(d, half), triton.next_power_of_2(d)
    width = 2 * block_half + block_pass
    tuned = qkv.is_cuda and not interpreting() and rows >= _BWD_TILES[0][0]  # small inputs: the one fixed tiling
    tile = _INTERPRETER_TILE if interpreting() else (min(t for t, _ in _BWD_TILES) if tuned else _BWD_TILE)
    block_r, block_rv = _tiles(rows, width, tile), _tiles(t * hkv, block_d, tile)
    qk_tiles, v_tiles = triton.cdiv(rows, block_r), triton.cdiv(t * hkv, block_rv)
    cap = _INTERPRETER_PROGRAMS if interpreting() or not qkv.is_cuda else _BWD_PER_SM * sm_count(qkv.device.index or 0)
    programs = max(1, min(max(qk_tiles, v_tiles), cap))  # the same for every tuned tiling
    dw_part = torch.empty((2, programs, d), dtype=torch.float32, device=qkv.device) if compute_dw else dqkv
    args = (dq, dk, dv, qkv, positions.contiguous(), cos, sin,
            q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv, rstd if has_norm else dq,
            dqkv, dw_part, t, hq, hkv, qkv.stride(0), cos.stride(0))  # fmt: skip
    consts = dict(D=d, HALF=half, HAS_NORM=has_norm, COMPUTE_DW=compute_dw, BLOCK_HALF=block_half,
                  BLOCK_PASS=block_pass, BLOCK_D=block_d)
    if tuned:  # the tile counts follow each candidate's rows per tile
        _tuned_bwd(width, block_d)[(programs,)](*args, _pow2_bucket(rows), **consts)
    else:
        _qk_norm_rope_bwd_kernel[(programs,)](*args, _pow2_bucket(rows), **consts, BLOCK_R=block_r, BLOCK_RV=block_rv,
                                              num_warps=_BWD_WARPS)
    if not compute_dw:
        return dqkv, None, None
    if q_norm_weight.dtype == k_norm_weight.dtype:  # one small reduction (and rounding) for both weights
        dw = sum_rows(dw_part, q_norm_weight.dtype)
        return dqkv, dw[0], dw[1]
    return dqkv, sum_rows(dw_part[0], q_norm_weight.dtype), sum_rows(dw_part[1], k_norm_weight.dtype)


class QKNormRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight, eps):
        heads = (num_heads, num_kv_heads, head_dim)
        q, k, rstd = qk_norm_rope_fwd(qkv, positions, cos, sin, *heads, q_norm_weight, k_norm_weight, eps)
        ctx.heads = heads
        ctx.save_for_backward(qkv, positions, cos, sin, q_norm_weight, k_norm_weight, rstd)
        # v is returned as a view of the input: autograd hands its gradient to backward() (in-place ops on it raise)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].unflatten(1, (num_kv_heads, head_dim))
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, positions, cos, sin, wq, wk, rstd = ctx.saved_tensors
        need_wq, need_wk = ctx.needs_input_grad[7], ctx.needs_input_grad[8]
        dqkv, dwq, dwk = qk_norm_rope_bwd(
            dq, dk, dv, qkv, positions, cos, sin, *ctx.heads, wq, wk, rstd, compute_dweight=need_wq or need_wk
        )
        return dqkv, None, None, None, None, None, None, (dwq if need_wq else None), (dwk if need_wk else None), None


def qk_norm_rope_native(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
                        eps):  # fmt: skip
    """The unfused chain (split -> rms_norm -> apply_rope natives): the oracle and the CPU path; differentiable."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm_native(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rms_norm_native(k, k_norm_weight, eps)
    return apply_rope_native(q, positions, cos, sin), apply_rope_native(k, positions, cos, sin), v


def _check(qkv, positions, cos, sin, q_norm_weight, k_norm_weight, hq, hkv, d):
    check_prologue_inputs("qk_norm_rope", qkv, positions, cos, sin,
                          {"q_norm_weight": q_norm_weight, "k_norm_weight": k_norm_weight}, hq, hkv, d)
    devices = {x.device for x in (qkv, positions, cos, sin, q_norm_weight, k_norm_weight) if x is not None}
    if len(devices) > 1:
        raise ValueError(f"qk_norm_rope: tensors on different devices: {sorted(map(str, devices))}")


def qk_norm_rope(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight, eps):
    """Per-head RMSNorm of q and k (weights optional), then NeoX RoPE, differentiable: one launch each way.

    ``qkv [T, (Hq + 2*Hkv) * D]`` (any row stride) holds this rank's heads (local counts under TP); ``cos``/``sin``
    fp32 ``[P, rotary_dim/2]``; positions lie in ``[0, P)`` (not checked: no host sync). Returns ``q [T, Hq, D]``
    and ``k [T, Hkv, D]`` (new) and ``v``, a ``[T, Hkv, D]`` view of ``qkv``; the same values as
    :func:`qk_norm_rope_native`. The kernels need both weights or neither, in qkv's dtype; else the native path runs.
    """
    heads = (num_heads, num_kv_heads, head_dim)
    _check(qkv, positions, cos, sin, q_norm_weight, k_norm_weight, *heads)
    weights = [w for w in (q_norm_weight, k_norm_weight) if w is not None]
    supported = (
        head_dim <= MAX_HEAD_DIM
        and len(weights) in (0, 2)
        and all(w.dtype == qkv.dtype and w.stride(0) == 1 for w in weights)
    )
    if use_triton(qkv, positions, cos, sin, q_norm_weight, k_norm_weight, supported=supported):
        return QKNormRopeFunction.apply(qkv, positions, cos, sin, *heads, q_norm_weight, k_norm_weight, eps)
    return qk_norm_rope_native(qkv, positions, cos, sin, *heads, q_norm_weight, k_norm_weight, eps)
