"""Gated delta rule (KDA / Gated DeltaNet linear attention): chunked Triton forward/backward, native chunked PyTorch
path, float64 naive recurrence, fused recurrent decode step, dispatch.

Per sequence and head, with a state S [K, V] (fp32), for t = 1..L:

    S_t = diag(exp(g_t)) S_{t-1}                       decay first (g_t <= 0: per channel [K] for KDA, or one
                                                        scalar per head for Gated DeltaNet, broadcast over K)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T          delta-rule write with the decayed state, beta_t in (0, 1)
    o_t = scale * S_t^T q_t                             scale defaults to K ** -0.5

S_0 is ``initial_state`` (zeros if None). This is the order transformers' ``bailing_hybrid`` (fla's KDA) runs; q/k
normalisation and the gate parametrisation (lower bound, softplus, ...) are the caller's job: g is the final
log-decay. Inputs are packed varlen: q, k [T, H, K], v [T, H, V], g [T, H, K] or [T, H], beta [T, H]; sequence n is
rows cu_seqlens[n]:cu_seqlens[n+1] (cu_seqlens None: one sequence). States are [N, H, K, V] fp32.

Chunked form (chunk of C tokens, gamma_t = cumsum of g inside the chunk, S0 the state at the chunk start). Writing
S_t = Gamma_t (S0 + sum_{i<=t} Gamma_i^-1 k_i w_i^T) with Gamma_t = diag(exp(gamma_t)), the new values w_i solve
a unit lower-triangular system (the WY / UT transform):

    (I + A) W = diag(beta) (V - (K * e^gamma) S0),   A_ti = beta_t sum_c k_tc k_ic exp(gamma_tc - gamma_ic)  (i < t)
    so W = U - Wk S0 with U = (I + A)^-1 diag(beta) V and Wk = (I + A)^-1 diag(beta) (K * e^gamma)
    O = scale * ((Q * e^gamma) S0 + M W),               M_ti = sum_c q_tc k_ic exp(gamma_tc - gamma_ic)  (i <= t)
    S_next = e^gamma_C * S0 + (K * e^(gamma_C - gamma))^T W

Every exponent used is <= 0: pairs (t, i) in different sub-blocks of 16 rows are factored through the first row r
of t's sub-block (exp(gamma_t - gamma_r) * exp(gamma_r - gamma_i)) so they run as matmuls; pairs inside a
sub-block are formed element by element. Only the state pass (S0 of each chunk) is sequential over chunks.
FLOPs per token and head (K = V = D, C = 64): about 2*D*(3C + 4D) forward, 2.5x that backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import interpreting, use_triton
from areno.kernels.linear_attn.steps import replay_through, step_aside, step_through

__all__ = [
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule_step", "fused_recurrent_gated_delta_rule_verify",
    "delta_rule_reference",
    "chunk_gated_delta_rule_native", "gated_delta_rule_step_native",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TRITON_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
TRITON_STATE_DTYPES = (torch.float32, torch.bfloat16)  # the decode steps' state pools in Triton (bf16: fp32 math)
STEP_STATE_DTYPES = (*TRITON_STATE_DTYPES, torch.float64)  # and the native step's (fp64: the tests' oracle)
CHUNKS = (16, 32, 64)
MAX_DIM = 128  # head dims the Triton tiles hold (K = V = 128 fits sm_90 shared memory, checked by compiling)
SUB = 16  # sub-block rows for the intra-chunk decay factorisation
MIN_BLOCK = 16  # smallest tile side (tl.dot's minimum on a GPU; interpreter tests lower it and SUB to run fast)


# ---------------------------------------------------------------------------------------------------------------
# Float64-capable naive recurrence (the test oracle)


def _seqs(cu_seqlens, total: int) -> list[int]:
    return [0, total] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]


def delta_rule_reference(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True,
                         cu_seqlens=None):
    """Token-by-token recurrence in the inputs' dtype (pass float64 for an oracle); differentiable.

    Returns (o [T, H, V], final_state [N, H, K, V] or None). Host-syncs on cu_seqlens (a test path).
    """
    T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    cu = _seqs(cu_seqlens, T)
    gk = g if g.dim() == 3 else g[..., None].expand(T, H, K)
    outs, finals = [], []
    for n in range(len(cu) - 1):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].to(q.dtype)
        for t in range(cu[n], cu[n + 1]):
            S = S * gk[t].exp()[..., None]
            kv = torch.einsum("hkv,hk->hv", S, k[t])
            S = S + k[t][..., None] * (beta[t][:, None] * (v[t] - kv))[:, None, :]
            outs.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
        finals.append(S)
    o = torch.stack(outs) if outs else v.new_zeros(0, H, V)
    return o, (torch.stack(finals) if output_final_state else None)


# ---------------------------------------------------------------------------------------------------------------
# Native chunked path (PyTorch, differentiable through autograd; the GPU baseline for bench/delta_rule.py)


def _decayed_scores(a, b, gam, inclusive: bool):
    """[..., C, C]: P_ti = sum_c a_tc b_ic exp(gam_tc - gam_ic) for i < t (i <= t if inclusive), else 0.

    a, b [..., C, K]; gam [..., C, K] (per channel, non-increasing along C) or [..., C] (scalar). Every exp has a
    non-positive argument (see the module docstring)."""
    C = a.shape[-2]
    rows = torch.arange(C, device=a.device)
    keep = rows[:, None] >= rows[None, :] if inclusive else rows[:, None] > rows[None, :]
    if gam.dim() == a.dim() - 1:  # scalar gate: one [C, C] decay matrix
        d = (gam[..., :, None] - gam[..., None, :]).masked_fill(~keep, float("-inf"))
        return (a @ b.transpose(-1, -2)) * d.exp()
    blocks = []
    for r0 in range(0, C, SUB):
        r1 = min(r0 + SUB, C)
        gr = gam[..., r0:r0 + 1, :]
        parts = []
        if r0 > 0:  # earlier sub-blocks, factored through row r0
            ar = a[..., r0:r1, :] * (gam[..., r0:r1, :] - gr).exp()
            br = b[..., :r0, :] * (gr - gam[..., :r0, :]).exp()
            parts.append(ar @ br.transpose(-1, -2))
        d = gam[..., r0:r1, None, :] - gam[..., None, r0:r1, :]  # [..., s, s, K]
        d = d.masked_fill(~keep[r0:r1, r0:r1, None], float("-inf"))
        parts.append(torch.einsum("...tc,...ic,...tic->...ti", a[..., r0:r1, :], b[..., r0:r1, :], d.exp()))
        if r1 < C:
            parts.append(a.new_zeros(*a.shape[:-2], r1 - r0, C - r1))
        blocks.append(torch.cat(parts, dim=-1))
    return torch.cat(blocks, dim=-2)


def _chunk_index(cu: list[int], C: int, device):
    """(gather index [N, nc*C] into the packed rows, sentinel = T for padding, valid mask, nc)."""
    lens = [cu[n + 1] - cu[n] for n in range(len(cu) - 1)]
    nc = max(1, max((-(-L // C) for L in lens), default=1))
    pos = torch.arange(nc * C, device=device)
    start = torch.tensor(cu[:-1], device=device)[:, None]
    valid = pos[None, :] < torch.tensor(lens, device=device)[:, None]
    idx = torch.where(valid, start + pos[None, :], torch.full_like(pos[None, :], cu[-1]))
    return idx, valid, nc


def chunk_gated_delta_rule_native(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                                  cu_seqlens=None, chunk_size=64):
    """The chunked algorithm in plain PyTorch (fp32 math, float64 for float64 inputs); same contract as
    :func:`chunk_gated_delta_rule`. Sequences are padded to whole chunks (padding rows: k = v = g = beta = 0, which
    leaves the state unchanged) and batched; the state pass loops over chunk positions. Host-syncs on cu_seqlens."""
    T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu = _seqs(cu_seqlens, T)
    N = len(cu) - 1
    idx, valid, nc = _chunk_index(cu, C, q.device)
    scalar = g.dim() == 2

    def chunks(x):  # [T, H, *] -> [N, H, nc, C, *] in the compute dtype, zero padded
        x = x.to(compute)
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[idx]  # [N, nc*C, H, *]
        x = x.view(N, nc, C, *x.shape[2:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))
    gam = gc.cumsum(3)  # [N, H, nc, C(, K)]
    gam_e = gam if not scalar else gam[..., None]  # broadcastable against [.., C, K]
    A = bc[..., None] * _decayed_scores(kc, kc, gam, inclusive=False)
    Mqk = _decayed_scores(qc, kc, gam, inclusive=True)
    kb = bc[..., None] * kc
    rhs = torch.cat([kb * gam_e.exp(), bc[..., None] * vc], dim=-1)
    sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # (I + A)^-1 [beta K e^g | beta V]
    Wk, U = sol[..., :K], sol[..., K:]
    last = gam_e[..., -1:, :]  # [N, H, nc, 1, K or 1]
    kd = kc * (last - gam_e).exp()
    decay = last.transpose(-1, -2).exp()  # [N, H, nc, K or 1, 1]
    S = (initial_state.to(compute) if initial_state is not None else q.new_zeros(N, H, K, V, dtype=compute))
    states, news = [], []
    for c in range(nc):
        W = U[:, :, c] - Wk[:, :, c] @ S
        states.append(S)
        news.append(W)
        S = decay[:, :, c] * S + kd[:, :, c].transpose(-1, -2) @ W
    S_all, W_all = torch.stack(states, 2), torch.stack(news, 2)
    o = scale * ((qc * gam_e.exp()) @ S_all + Mqk @ W_all)  # [N, H, nc, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(N, nc * C, H, V)[valid]
    return o.to(q.dtype), (S if output_final_state else None)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels. Layout: q, k [T, H, K], v [T, H, V] contiguous; gamma (in-chunk cumsum of g) fp32 [T, H, K] or
# [T, H]; per chunk c (global index over all sequences) and head h: T = (I + A)^-1 [C, C], M = M_qk [C, C] and the
# chunk-start state S_c [K, V] (fp32 buffers). One program per (chunk, head) except the two state passes, which
# run one program per (sequence, head, V block) sequentially over the sequence's chunks.


@triton.jit
def _scores(a, b, gam, b_base, g_base, stride, n, offs_t, offs_k, kmask,
            INCL: tl.constexpr, SCALAR: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, PREC: tl.constexpr):
    """[C, C] P_ti = sum_c a_tc b_ic exp(gam_tc - gam_ic) over kept pairs (i < t, or i <= t if INCL; both < n).

    a, b [C, BK] fp32 rows of this chunk (b also at b_base + i * stride for gathers); gam [C, BK] or [C] (SCALAR).
    Exponents are clamped at 0, which is exact for g <= 0 and keeps masked lanes finite."""
    rows = offs_t[:, None]
    cols = offs_t[None, :]
    keep = (cols <= rows) if INCL else (cols < rows)
    keep = keep & (rows < n)
    if SCALAR:
        d = tl.exp(tl.minimum(gam[:, None] - gam[None, :], 0.0))
        p = tl.dot(a, tl.trans(b), input_precision=PREC) * d
    else:
        p = tl.zeros([C, C], dtype=tl.float32)
        for rb in tl.static_range(1, C // SUBC):  # rows of sub-block rb against earlier columns, through row r
            r = rb * SUBC
            gr = tl.load(g_base + r * stride + offs_k, mask=kmask & (r < n), other=0.0)
            inb = (offs_t >= r) & (offs_t < r + SUBC)
            ar = tl.where(inb[:, None], a * tl.exp(tl.minimum(gam - gr[None, :], 0.0)), 0.0)
            br = tl.where((offs_t < r)[:, None], b * tl.exp(tl.minimum(gr[None, :] - gam, 0.0)), 0.0)
            p += tl.dot(ar, tl.trans(br), input_precision=PREC)
        for j in range(SUBC):  # inside a sub-block: column i = block start + j, element by element
            i_idx = (offs_t // SUBC) * SUBC + j
            ok = (i_idx <= offs_t) if INCL else (i_idx < offs_t)
            ok = ok & (i_idx < n)
            m2 = ok[:, None] & kmask[None, :]
            bj = tl.load(b_base + i_idx[:, None] * stride + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
            gj = tl.load(g_base + i_idx[:, None] * stride + offs_k[None, :], mask=m2, other=0.0)
            val = tl.sum(a * bj * tl.exp(tl.minimum(gam - gj, 0.0)), axis=1)
            p += tl.where(cols == i_idx[:, None], val[:, None], 0.0)
    return tl.where(keep, p, 0.0)


@triton.jit
def _scores_bwd(dpr, dpc, a, b, gam, a_base, b_base, g_base, stride, n, offs_t, offs_k, kmask,
                INCL: tl.constexpr, SCALAR: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, PREC: tl.constexpr):
    """Backward of _scores, rows and columns with separate upstreams: (da, db) with
    da_t = sum_i dpr_ti b_i exp(gam_t - gam_i), db_i = sum_t dpc_ti a_t exp(gam_t - gam_i) over kept pairs.
    (The gamma gradient is then a * da - b * db.)"""
    rows = offs_t[:, None]
    cols = offs_t[None, :]
    keep = (cols <= rows) if INCL else (cols < rows)
    keep = keep & (rows < n)
    dpr = tl.where(keep, dpr, 0.0)
    dpc = tl.where(keep, dpc, 0.0)
    if SCALAR:
        d = tl.exp(tl.minimum(gam[:, None] - gam[None, :], 0.0))
        da = tl.dot(dpr * d, b, input_precision=PREC)
        db = tl.dot(tl.trans(dpc * d), a, input_precision=PREC)
    else:
        da = tl.zeros(a.shape, dtype=tl.float32)
        db = tl.zeros(a.shape, dtype=tl.float32)
        for rb in tl.static_range(1, C // SUBC):
            r = rb * SUBC
            gr = tl.load(g_base + r * stride + offs_k, mask=kmask & (r < n), other=0.0)
            inb = (offs_t >= r) & (offs_t < r + SUBC)
            early = offs_t < r
            er = tl.exp(tl.minimum(gam - gr[None, :], 0.0))
            ec = tl.exp(tl.minimum(gr[None, :] - gam, 0.0))
            ar = tl.where(inb[:, None], a * er, 0.0)
            br = tl.where(early[:, None], b * ec, 0.0)
            blk = inb[:, None] & (cols < r)
            da += tl.where(inb[:, None], er * tl.dot(tl.where(blk, dpr, 0.0), br, input_precision=PREC), 0.0)
            db += tl.where(early[:, None], ec * tl.dot(tl.trans(tl.where(blk, dpc, 0.0)), ar,
                                                       input_precision=PREC), 0.0)
        for j in range(SUBC):
            idx = (offs_t // SUBC) * SUBC + j
            # rows: partner column i = idx(t)
            ok = (idx <= offs_t) if INCL else (idx < offs_t)
            m2 = (ok & (idx < n))[:, None] & kmask[None, :]
            bj = tl.load(b_base + idx[:, None] * stride + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
            gj = tl.load(g_base + idx[:, None] * stride + offs_k[None, :], mask=m2, other=0.0)
            coef = tl.sum(tl.where(cols == idx[:, None], dpr, 0.0), axis=1)
            da += coef[:, None] * bj * tl.exp(tl.minimum(gam - gj, 0.0))
            # columns: partner row t = idx(i)
            okc = (idx >= offs_t) if INCL else (idx > offs_t)
            m2 = (okc & (idx < n))[:, None] & kmask[None, :]
            at = tl.load(a_base + idx[:, None] * stride + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
            gt = tl.load(g_base + idx[:, None] * stride + offs_k[None, :], mask=m2, other=0.0)
            coefc = tl.sum(tl.where(rows == idx[None, :], dpc, 0.0), axis=0)
            db += coefc[:, None] * at * tl.exp(tl.minimum(gt - gam, 0.0))
    return da, db


@triton.jit
def _load_tile(base, row_stride, offs_t, n, offs_c, ncols):
    m = (offs_t < n)[:, None] & (offs_c < ncols)[None, :]
    return tl.load(base + offs_t[:, None] * row_stride + offs_c[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _store_tile(base, row_stride, offs_t, n, offs_c, ncols, x):
    m = (offs_t < n)[:, None] & (offs_c < ncols)[None, :]
    tl.store(base + offs_t[:, None] * row_stride + offs_c[None, :], x.to(base.dtype.element_ty), mask=m)


@triton.jit
def _load_gamma(GAM, row0, h, H, K, offs_t, n, offs_k, SCALAR: tl.constexpr):
    """(gam for _scores, gam broadcastable against [C, BK], gam of row n - 1 broadcastable against [BK])."""
    if SCALAR:
        gs = tl.load(GAM + (row0 + offs_t) * H + h, mask=offs_t < n, other=0.0)
        gl = tl.load(GAM + (row0 + n - 1) * H + h)
        return gs, gs[:, None], gl
    else:
        g2 = _load_tile(GAM + row0 * H * K + h * K, H * K, offs_t, n, offs_k, K)
        gl = tl.load(GAM + (row0 + n - 1) * H * K + h * K + offs_k, mask=offs_k < K, other=0.0)
        return g2, g2, gl


@triton.jit
def _cumsum_kernel(G, GAM, CHUNK_BOS, CHUNK_LEN, H, K, SCALAR: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    c, h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(CHUNK_BOS + c), tl.load(CHUNK_LEN + c)
    offs_t = tl.arange(0, C)
    if SCALAR:
        g = tl.load(G + (bos + offs_t) * H + h, mask=offs_t < n, other=0.0).to(tl.float32)
        tl.store(GAM + (bos + offs_t) * H + h, tl.cumsum(g, axis=0), mask=offs_t < n)
    else:
        offs_k = tl.arange(0, BK)
        g = _load_tile(G + bos * H * K + h * K, H * K, offs_t, n, offs_k, K)
        _store_tile(GAM + bos * H * K + h * K, H * K, offs_t, n, offs_k, K, tl.cumsum(g, axis=0))


@triton.jit
def _prep_kernel(K_, V_, BETA, GAM, TM, WK, U, CHUNK_BOS, CHUNK_LEN, H, K, V,
                 SCALAR: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 PREC: tl.constexpr):
    """T = (I + A)^-1 by forward substitution, Wk = T (beta K e^gamma), U = T (beta V)."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(CHUNK_BOS + c), tl.load(CHUNK_LEN + c)
    offs_t, offs_k, offs_v = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    kmask = offs_k < K
    kbase = K_ + bos * H * K + h * K
    gbase = GAM + bos * H * K + h * K
    k = _load_tile(kbase, H * K, offs_t, n, offs_k, K)
    gs, g2, gl = _load_gamma(GAM, bos, h, H, K, offs_t, n, offs_k, SCALAR)
    beta = tl.load(BETA + (bos + offs_t) * H + h, mask=offs_t < n, other=0.0).to(tl.float32)
    a = beta[:, None] * _scores(k, k, gs, kbase, gbase, H * K, n, offs_t, offs_k, kmask,
                                False, SCALAR, C, SUBC, PREC)
    rows = offs_t[:, None]
    tm = tl.where(rows == offs_t[None, :], 1.0, 0.0)
    for i in range(1, C):  # row i of T: e_i - A[i, :i] T[:i, :]
        a_i = tl.sum(tl.where(rows == i, a, 0.0), axis=0)
        tm = tl.where(rows == i, tm - tl.sum(a_i[:, None] * tm, axis=0)[None, :], tm)
    c64 = c.to(tl.int64)
    tl.store(TM + (c64 * H + h) * C * C + rows * C + offs_t[None, :], tm)
    wk = tl.dot(tm, beta[:, None] * k * tl.exp(g2), input_precision=PREC)
    _store_tile(WK + bos * H * K + h * K, H * K, offs_t, n, offs_k, K, wk)
    for v0 in range(0, V, BV):
        v = _load_tile(V_ + bos * H * V + h * V + v0, H * V, offs_t, n, offs_v, V - v0)
        u = tl.dot(tm, beta[:, None] * v, input_precision=PREC)
        _store_tile(U + bos * H * V + h * V + v0, H * V, offs_t, n, offs_v, V - v0, u)


@triton.jit
def _state_fwd_kernel(K_, GAM, WK, U, W, SBUF, S0, SFIN, CU, SEQ_CHUNK, H, K, V,
                      HAS_S0: tl.constexpr, SCALAR: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, PREC: tl.constexpr):
    """Sequential over the chunks of one sequence: store S_c, W = U - Wk S_c, S <- e^gamma_C S + Kd^T W."""
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_bos, seq_eos = tl.load(CU + s), tl.load(CU + s + 1)
    c0, c1 = tl.load(SEQ_CHUNK + s), tl.load(SEQ_CHUNK + s + 1)
    offs_t, offs_k, offs_v = tl.arange(0, C), tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    smask = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    soffs = offs_k[:, None] * V + offs_v[None, :]
    if HAS_S0:
        S = tl.load(S0 + (s * H + h).to(tl.int64) * K * V + soffs, mask=smask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(c0, c1):
        bos = seq_bos + (c - c0) * C
        n = tl.minimum(C, seq_eos - bos)
        tl.store(SBUF + (c * H + h).to(tl.int64) * K * V + soffs, S, mask=smask)
        wk = _load_tile(WK + bos * H * K + h * K, H * K, offs_t, n, offs_k, K)
        u = _load_tile(U + bos * H * V + h * V, H * V, offs_t, n, offs_v, V)
        w = u - tl.dot(wk, S, input_precision=PREC)
        _store_tile(W + bos * H * V + h * V, H * V, offs_t, n, offs_v, V, w)
        k = _load_tile(K_ + bos * H * K + h * K, H * K, offs_t, n, offs_k, K)
        gs, g2, gl = _load_gamma(GAM, bos, h, H, K, offs_t, n, offs_k, SCALAR)
        kd = tl.where((offs_t < n)[:, None], k * tl.exp(tl.minimum(gl - g2, 0.0)), 0.0)
        if SCALAR:
            S = S * tl.exp(gl)
        else:
            S = S * tl.exp(gl)[:, None]
        S += tl.dot(tl.trans(kd), w, input_precision=PREC)
    tl.store(SFIN + (s * H + h).to(tl.int64) * K * V + soffs, S, mask=smask)


@triton.jit
def _out_kernel(Q, K_, GAM, W, SBUF, O, MQK, CHUNK_BOS, CHUNK_LEN, scale, H, K, V,
                SCALAR: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                PREC: tl.constexpr):
    """O = scale ((Q e^gamma) S_c + M W); M is saved for the backward."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(CHUNK_BOS + c), tl.load(CHUNK_LEN + c)
    offs_t, offs_k, offs_v = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    kmask = offs_k < K
    kbase = K_ + bos * H * K + h * K
    q = _load_tile(Q + bos * H * K + h * K, H * K, offs_t, n, offs_k, K)
    k = _load_tile(kbase, H * K, offs_t, n, offs_k, K)
    gs, g2, gl = _load_gamma(GAM, bos, h, H, K, offs_t, n, offs_k, SCALAR)
    m = _scores(q, k, gs, kbase, GAM + bos * H * K + h * K, H * K, n, offs_t, offs_k, kmask,
                True, SCALAR, C, SUBC, PREC)
    c64 = c.to(tl.int64)
    tl.store(MQK + (c64 * H + h) * C * C + offs_t[:, None] * C + offs_t[None, :], m)
    qe = q * tl.exp(g2)
    for v0 in range(0, V, BV):
        sm = kmask[:, None] & (v0 + offs_v < V)[None, :]
        S = tl.load(SBUF + (c64 * H + h) * K * V + offs_k[:, None] * V + v0 + offs_v[None, :], mask=sm, other=0.0)
        w = _load_tile(W + bos * H * V + h * V + v0, H * V, offs_t, n, offs_v, V - v0)
        o = scale * (tl.dot(qe, S, input_precision=PREC) + tl.dot(m, w, input_precision=PREC))
        _store_tile(O + bos * H * V + h * V + v0, H * V, offs_t, n, offs_v, V - v0, o)


@triton.jit
def _state_bwd_kernel(Q, K_, GAM, WK, MQK, DO, DW, DHBUF, DFIN, DS0, CU, SEQ_CHUNK, scale, H, K, V,
                      HAS_DFIN: tl.constexpr, SCALAR: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, PREC: tl.constexpr):
    """Reverse over chunks: dh is the gradient of the chunk's end state. dW = scale M^T dO + Kd dh;
    dh <- e^gamma_C dh + scale (Q e^gamma)^T dO - Wk^T dW."""
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_bos, seq_eos = tl.load(CU + s), tl.load(CU + s + 1)
    c0, c1 = tl.load(SEQ_CHUNK + s), tl.load(SEQ_CHUNK + s + 1)
    offs_t, offs_k, offs_v = tl.arange(0, C), tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    smask = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    soffs = offs_k[:, None] * V + offs_v[None, :]
    if HAS_DFIN:
        dh = tl.load(DFIN + (s * H + h).to(tl.int64) * K * V + soffs, mask=smask, other=0.0).to(tl.float32)
    else:
        dh = tl.zeros([BK, BV], dtype=tl.float32)
    for cc in range(c0, c1):
        c = c1 - 1 - (cc - c0)
        bos = seq_bos + (c - c0) * C
        n = tl.minimum(C, seq_eos - bos)
        ch = (c * H + h).to(tl.int64)
        tl.store(DHBUF + ch * K * V + soffs, dh, mask=smask)
        m = tl.load(MQK + ch * C * C + offs_t[:, None] * C + offs_t[None, :])
        do = _load_tile(DO + bos * H * V + h * V, H * V, offs_t, n, offs_v, V)
        k = _load_tile(K_ + bos * H * K + h * K, H * K, offs_t, n, offs_k, K)
        q = _load_tile(Q + bos * H * K + h * K, H * K, offs_t, n, offs_k, K)
        wk = _load_tile(WK + bos * H * K + h * K, H * K, offs_t, n, offs_k, K)
        gs, g2, gl = _load_gamma(GAM, bos, h, H, K, offs_t, n, offs_k, SCALAR)
        kd = tl.where((offs_t < n)[:, None], k * tl.exp(tl.minimum(gl - g2, 0.0)), 0.0)
        dw = scale * tl.dot(tl.trans(m), do, input_precision=PREC) + tl.dot(kd, dh, input_precision=PREC)
        _store_tile(DW + bos * H * V + h * V, H * V, offs_t, n, offs_v, V, dw)
        qe = q * tl.exp(g2)
        if SCALAR:
            dh = dh * tl.exp(gl)
        else:
            dh = dh * tl.exp(gl)[:, None]
        dh += scale * tl.dot(tl.trans(qe), do, input_precision=PREC) - tl.dot(tl.trans(wk), dw, input_precision=PREC)
    tl.store(DS0 + (s * H + h).to(tl.int64) * K * V + soffs, dh, mask=smask)


@triton.jit
def _bwd_chunk_kernel(Q, K_, V_, BETA, GAM, TM, W, DW, SBUF, DHBUF, DO, DQ, DK, DV, DG, DBETA,
                      CHUNK_BOS, CHUNK_LEN, scale, H, K, V,
                      SCALAR: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, PREC: tl.constexpr):
    """Everything of one chunk given W, dW, S_c and dh (end-state gradient): dq, dk, dv, dbeta, dg."""
    c, h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(CHUNK_BOS + c), tl.load(CHUNK_LEN + c)
    offs_t, offs_k, offs_v = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    kmask = offs_k < K
    rmask = offs_t < n
    c64 = c.to(tl.int64)
    qbase = Q + bos * H * K + h * K
    kbase = K_ + bos * H * K + h * K
    gbase = GAM + bos * H * K + h * K
    q = _load_tile(qbase, H * K, offs_t, n, offs_k, K)
    k = _load_tile(kbase, H * K, offs_t, n, offs_k, K)
    gs, g2, gl = _load_gamma(GAM, bos, h, H, K, offs_t, n, offs_k, SCALAR)
    beta = tl.load(BETA + (bos + offs_t) * H + h, mask=rmask, other=0.0).to(tl.float32)
    tm = tl.load(TM + (c64 * H + h) * C * C + offs_t[:, None] * C + offs_t[None, :])
    e = tl.where(rmask[:, None], tl.exp(g2), 0.0)
    kbe = beta[:, None] * k * e
    dqe = tl.zeros([C, BK], dtype=tl.float32)
    dwk = tl.zeros([C, BK], dtype=tl.float32)
    dkd = tl.zeros([C, BK], dtype=tl.float32)
    ddec = tl.zeros([BK], dtype=tl.float32)
    dm = tl.zeros([C, C], dtype=tl.float32)
    dt = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        sm = kmask[:, None] & (v0 + offs_v < V)[None, :]
        soffs = (c64 * H + h) * K * V + offs_k[:, None] * V + v0 + offs_v[None, :]
        S = tl.load(SBUF + soffs, mask=sm, other=0.0)
        dh = tl.load(DHBUF + soffs, mask=sm, other=0.0)
        w = _load_tile(W + bos * H * V + h * V + v0, H * V, offs_t, n, offs_v, V - v0)
        dw = _load_tile(DW + bos * H * V + h * V + v0, H * V, offs_t, n, offs_v, V - v0)
        do = _load_tile(DO + bos * H * V + h * V + v0, H * V, offs_t, n, offs_v, V - v0)
        v = _load_tile(V_ + bos * H * V + h * V + v0, H * V, offs_t, n, offs_v, V - v0)
        dqe += tl.dot(do, tl.trans(S), input_precision=PREC)
        dm += tl.dot(do, tl.trans(w), input_precision=PREC)
        dwk -= tl.dot(dw, tl.trans(S), input_precision=PREC)
        dkd += tl.dot(w, tl.trans(dh), input_precision=PREC)
        ddec += tl.sum(dh * S, axis=1)
        dbv = tl.dot(tl.trans(tm), dw, input_precision=PREC)  # U = T (beta V), dU = dW
        _store_tile(DV + bos * H * V + h * V + v0, H * V, offs_t, n, offs_v, V - v0, beta[:, None] * dbv)
        dbeta += tl.sum(v * dbv, axis=1)
        dt += tl.dot(dw, tl.trans(beta[:, None] * v), input_precision=PREC)
    dqe *= scale
    dm *= scale
    # Wk = T (beta K e^gamma)
    dt += tl.dot(dwk, tl.trans(kbe), input_precision=PREC)
    dkbe = tl.dot(tl.trans(tm), dwk, input_precision=PREC)
    dk = beta[:, None] * e * dkbe
    dbeta += tl.sum(k * e * dkbe, axis=1)
    dgam = kbe * dkbe
    # T = (I + A)^-1: dA = -T^T dT T^T; A = beta_t P(k, k)
    da_mat = -tl.dot(tl.dot(tl.trans(tm), dt, input_precision=PREC), tl.trans(tm), input_precision=PREC)
    da, db = _scores_bwd(da_mat, beta[:, None] * da_mat, k, k, gs, kbase, kbase, gbase, H * K, n, offs_t, offs_k,
                         kmask, False, SCALAR, C, SUBC, PREC)
    dbeta += tl.sum(k * da, axis=1)
    dk += beta[:, None] * da + db
    dgam += beta[:, None] * k * da - k * db
    # O = scale ((Q e^gamma) S + M W), M = P(q, k) inclusive
    dqm, dkm = _scores_bwd(dm, dm, q, k, gs, qbase, kbase, gbase, H * K, n, offs_t, offs_k, kmask,
                           True, SCALAR, C, SUBC, PREC)
    dq = dqm + dqe * e
    dk += dkm
    dgam += q * dqm - k * dkm + q * e * dqe
    # S_next = e^gamma_C S + (K e^(gamma_C - gamma))^T W
    ed = tl.where(rmask[:, None], tl.exp(tl.minimum(gl - g2, 0.0)), 0.0)
    kdd = k * ed * dkd
    dk += ed * dkd
    dgam -= kdd
    dgl = tl.sum(kdd, axis=0) + tl.exp(gl) * ddec
    dgam += tl.where((offs_t == n - 1)[:, None], dgl[None, :], 0.0)
    dg = tl.cumsum(dgam, axis=0, reverse=True)
    _store_tile(DQ + bos * H * K + h * K, H * K, offs_t, n, offs_k, K, dq)
    _store_tile(DK + bos * H * K + h * K, H * K, offs_t, n, offs_k, K, dk)
    if SCALAR:
        tl.store(DG + (bos + offs_t) * H + h, tl.sum(tl.where(kmask[None, :], dg, 0.0), axis=1), mask=rmask)
    else:
        _store_tile(DG + bos * H * K + h * K, H * K, offs_t, n, offs_k, K, dg)
    tl.store(DBETA + (bos + offs_t) * H + h, dbeta, mask=rmask)


@triton.jit
def _delta_token(Q, K_, V_, G, BETA, row, S, offs_k, offs_v, kmask, vmask, scale, K, V, SCALAR: tl.constexpr):
    """One token of row ``row`` (token x H + head): S <- e^g S; S <- S + beta k (v - S^T k)^T; o = scale S^T q;
    returns (S, o)."""
    q = tl.load(Q + row * K + offs_k, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(K_ + row * K + offs_k, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(V_ + row * V + offs_v, mask=vmask, other=0.0).to(tl.float32)
    beta = tl.load(BETA + row).to(tl.float32)
    if SCALAR:
        S = S * tl.exp(tl.load(G + row).to(tl.float32))
    else:
        S = S * tl.exp(tl.load(G + row * K + offs_k, mask=kmask, other=0.0).to(tl.float32))[:, None]
    w = beta * (v - tl.sum(S * k[:, None], axis=0))
    S += k[:, None] * w[None, :]
    return S, scale * tl.sum(S * q[:, None], axis=0)


@triton.jit
def _step_kernel(Q, K_, V_, G, BETA, STATE, IDX, O, scale, H, K, V,
                 HAS_IDX: tl.constexpr, SCALAR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One token: S <- e^g S; S <- S + beta k (v - S^T k)^T; o = scale S^T q, on slot IDX[b] (-1: skip, o = 0).
    The state is read in its dtype (fp32 or bf16), updated in fp32 and stored back rounded to its dtype."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k, offs_v = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    kmask, vmask = offs_k < K, offs_v < V
    slot = tl.load(IDX + b) if HAS_IDX else b
    ok = slot >= 0
    smask = (kmask[:, None] & vmask[None, :]) & ok
    soffs = (tl.maximum(slot, 0).to(tl.int64) * H + h) * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(STATE + soffs, mask=smask, other=0.0).to(tl.float32)
    row = b * H + h
    S, o = _delta_token(Q, K_, V_, G, BETA, row, S, offs_k, offs_v, kmask, vmask, scale, K, V, SCALAR)
    tl.store(STATE + soffs, S.to(STATE.dtype.element_ty), mask=smask)
    tl.store(O + row * V + offs_v, tl.where(ok, o, 0.0).to(O.dtype.element_ty), mask=vmask)


@triton.jit
def _verify_kernel(Q, K_, V_, G, BETA, STATE, IDX, O, scale, H, K, V, N: tl.constexpr, WRITE: tl.constexpr,
                   SCALAR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """A speculative verify's N tokens of sequence b (tokens b N .. b N + N - 1) as N ``_step_kernel`` tokens with the
    state held in registers between them (rounded to the pool's dtype, as a store and reload round it). ``WRITE``:
    the state after the last to the pool; else only the outputs (``_replay_kernel`` commits the accepted tokens)."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k, offs_v = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    kmask, vmask = offs_k < K, offs_v < V
    slot = tl.load(IDX + b)
    ok = slot >= 0
    smask = (kmask[:, None] & vmask[None, :]) & ok
    tile = h * K * V + offs_k[:, None] * V + offs_v[None, :]
    soffs = tl.maximum(slot, 0).to(tl.int64) * H * K * V + tile
    S = tl.load(STATE + soffs, mask=smask, other=0.0).to(tl.float32)
    for i in tl.static_range(N):
        row = (b * N + i) * H + h
        S, o = _delta_token(Q, K_, V_, G, BETA, row, S, offs_k, offs_v, kmask, vmask, scale, K, V, SCALAR)
        tl.store(O + row * V + offs_v, tl.where(ok, o, 0.0).to(O.dtype.element_ty), mask=vmask)
        if i < N - 1:
            S = S.to(STATE.dtype.element_ty).to(tl.float32)
    if WRITE:
        tl.store(STATE + soffs, S.to(STATE.dtype.element_ty), mask=smask)


@triton.jit
def replay_tile(STATE, IDX, CNT, b, h, vb, H, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """A replay program's (sequence b, head h, value block vb) state tile: (S fp32, its offsets, its mask, the
    count of tokens to replay, offs_k, offs_v, kmask, vmask); a slot of -1 or a count of 0 loads and stores
    nothing."""
    offs_k, offs_v = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    kmask, vmask = offs_k < K, offs_v < V
    slot, cnt = tl.load(IDX + b), tl.load(CNT + b)
    smask = (kmask[:, None] & vmask[None, :]) & (slot >= 0) & (cnt > 0)
    soffs = tl.maximum(slot, 0).to(tl.int64) * H * K * V + h * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(STATE + soffs, mask=smask, other=0.0).to(tl.float32)
    return S, soffs, smask, cnt, offs_k, offs_v, kmask, vmask


@triton.jit
def _replay_kernel(K_, V_, G, BETA, STATE, IDX, CNT, H, K, V, N: tl.constexpr, SCALAR: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """The first CNT[b] of sequence b's N kept verify tokens on its state: ``_step_kernel``'s update a token (rounded
    to the pool's dtype after each, as its store rounds it), the state read once and written once."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    S, soffs, smask, cnt, offs_k, offs_v, kmask, vmask = replay_tile(STATE, IDX, CNT, b, h, vb, H, K, V, BK, BV)
    for i in tl.static_range(N):
        if i < cnt:  # a branch, not a select: one state tile in registers
            row = (b * N + i) * H + h  # no output: the keys stand in for the queries
            S, _ = _delta_token(K_, K_, V_, G, BETA, row, S, offs_k, offs_v, kmask, vmask, 1.0, K, V, SCALAR)
            S = S.to(STATE.dtype.element_ty).to(tl.float32)
    tl.store(STATE + soffs, S.to(STATE.dtype.element_ty), mask=smask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers and autograd


def _chunk_meta(cu: list[int], C: int, device):
    """(chunk start rows int32 [NC], chunk lengths int32 [NC], first chunk of each sequence int32 [N+1])."""
    bos, lens, first = [], [], [0]
    for n in range(len(cu) - 1):
        for s in range(cu[n], cu[n + 1], C):
            bos.append(s)
            lens.append(min(C, cu[n + 1] - s))
        first.append(len(bos))
    as32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    return as32(bos), as32(lens), as32(first)


# One pipeline stage: the [C, K] fp32 operands of the chunk matmuls would overflow shared memory if prefetched.
_LAUNCH = dict(num_warps=4, num_stages=1)


def _blocks(q, v, C):
    K, V = q.shape[-1], v.shape[-1]
    prec = "ieee" if interpreting() or q.dtype == torch.float32 else "tf32"
    lo = MIN_BLOCK
    return max(lo, triton.next_power_of_2(K)), max(lo, min(64, triton.next_power_of_2(V))), min(SUB, C), prec


def _delta_rule_fwd(q, k, v, g, beta, s0, scale, cu, meta, C):
    T, H, K = q.shape
    V = v.shape[-1]
    bos, lens, first = meta
    NC, N = bos.shape[0], first.shape[0] - 1
    scalar = g.dim() == 2
    BK, BV, SUBC, prec = _blocks(q, v, C)
    f32 = dict(dtype=torch.float32, device=q.device)
    gam = torch.empty(g.shape, **f32)
    tm = torch.empty(NC, H, C, C, **f32)
    wk, u, w = torch.empty(T, H, K, **f32), torch.empty(T, H, V, **f32), torch.empty(T, H, V, **f32)
    sbuf, sfin = torch.empty(NC, H, K, V, **f32), torch.empty(N, H, K, V, **f32)
    o, mqk = torch.empty(T, H, V, dtype=q.dtype, device=q.device), torch.empty(NC, H, C, C, **f32)
    if NC:
        _cumsum_kernel[(NC, H)](g, gam, bos, lens, H, K, SCALAR=scalar, C=C, BK=BK)
        _prep_kernel[(NC, H)](k, v, beta, gam, tm, wk, u, bos, lens, H, K, V,
                              SCALAR=scalar, C=C, SUBC=SUBC, BK=BK, BV=BV, PREC=prec, **_LAUNCH)
    _state_fwd_kernel[(N, H, triton.cdiv(V, BV))](
        k, gam, wk, u, w, sbuf, s0 if s0 is not None else sfin, sfin, cu, first, H, K, V,
        HAS_S0=s0 is not None, SCALAR=scalar, C=C, BK=BK, BV=BV, PREC=prec, **_LAUNCH,
    )  # fmt: skip
    if NC:
        _out_kernel[(NC, H)](q, k, gam, w, sbuf, o, mqk, bos, lens, scale, H, K, V,
                             SCALAR=scalar, C=C, SUBC=SUBC, BK=BK, BV=BV, PREC=prec, **_LAUNCH)
    return o, sfin, (gam, tm, wk, w, sbuf, mqk)


def _delta_rule_bwd(do, dsfin, q, k, v, g, beta, saved, scale, cu, meta, C):
    T, H, K = q.shape
    V = v.shape[-1]
    bos, lens, first = meta
    NC, N = bos.shape[0], first.shape[0] - 1
    gam, tm, wk, w, sbuf, mqk = saved
    scalar = g.dim() == 2
    BK, BV, SUBC, prec = _blocks(q, v, C)
    f32 = dict(dtype=torch.float32, device=q.device)
    dw, dhbuf, ds0 = torch.empty(T, H, V, **f32), torch.empty(NC, H, K, V, **f32), torch.empty(N, H, K, V, **f32)
    _state_bwd_kernel[(N, H, triton.cdiv(V, BV))](
        q, k, gam, wk, mqk, do, dw, dhbuf, dsfin if dsfin is not None else ds0, ds0, cu, first, scale, H, K, V,
        HAS_DFIN=dsfin is not None, SCALAR=scalar, C=C, BK=BK, BV=BV, PREC=prec, **_LAUNCH,
    )  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg, dbeta = torch.empty(g.shape, **f32), torch.empty(beta.shape, **f32)
    if NC:
        _bwd_chunk_kernel[(NC, H)](
            q, k, v, beta, gam, tm, w, dw, sbuf, dhbuf, do, dq, dk, dv, dg, dbeta, bos, lens, scale, H, K, V,
            SCALAR=scalar, C=C, SUBC=SUBC, BK=BK, BV=max(MIN_BLOCK, min(BV, 32)), PREC=prec, **_LAUNCH,
        )  # fmt: skip  (V tiles of 32: the per-chunk backward holds the most tiles; sm_90 shared memory <= 200 KB)
    return dq, dk, dv, dg.to(g.dtype), dbeta.to(beta.dtype), ds0


class ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0, scale, cu, chunk_size, meta):
        o, sfin, saved = _delta_rule_fwd(q, k, v, g, beta, s0, scale, cu, meta, chunk_size)
        ctx.save_for_backward(q, k, v, g, beta, cu, *meta, *saved)
        ctx.args = (scale, chunk_size, s0 is not None)
        return o, sfin

    @staticmethod
    def backward(ctx, do, dsfin):
        q, k, v, g, beta, cu, *rest = ctx.saved_tensors
        meta, saved = tuple(rest[:3]), tuple(rest[3:])
        scale, chunk_size, has_s0 = ctx.args
        grads = _delta_rule_bwd(do.contiguous(), dsfin.contiguous() if dsfin is not None else None, q, k, v, g, beta,
                                saved, scale, cu, meta, chunk_size)
        return *grads[:5], (grads[5] if has_s0 else None), None, None, None, None


def _chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size):
    T = q.shape[0]
    cu_list = _seqs(cu_seqlens, T)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=q.device)
    meta = _chunk_meta(cu_list, chunk_size, q.device)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    s0 = initial_state.float().contiguous() if initial_state is not None else None
    return ChunkGatedDeltaRule.apply(q, k, v, g, beta, s0, float(scale), cu, chunk_size, meta)


# ---------------------------------------------------------------------------------------------------------------
# Decode step


def gated_delta_rule_step_native(q, k, v, g, beta, state, *, scale=None, state_indices=None):
    """One token per sequence in PyTorch; updates ``state`` in place (rows ``state_indices``, -1 skipped) without a
    host sync, so it can be captured in a CUDA graph. Returns o [B, H, V] in q's dtype (0 for skipped rows)."""
    B, H, K = k.shape
    scale = K**-0.5 if scale is None else scale
    f, out_dtype = torch.promote_types(state.dtype, torch.float32), q.dtype  # a bf16 state: fp32 math, bf16 stored
    q, k, v, beta = q.to(f), k.to(f), v.to(f), beta.to(f)
    gk = (g if g.dim() == 3 else g[..., None].expand(B, H, K)).to(f)
    if state_indices is None:
        S = state.to(f)
    else:
        ok = state_indices >= 0
        slot = state_indices.long().clamp(min=0)
        S = state.index_select(0, slot).to(f)
    S = S * gk.exp()[..., None]
    kv = torch.einsum("bhkv,bhk->bhv", S, k)
    S = S + k[..., None] * (beta[..., None] * (v - kv))[:, :, None, :]
    o = scale * torch.einsum("bhkv,bhk->bhv", S, q)
    if state_indices is None:
        state.copy_(S)
        return o.to(out_dtype)
    # Skipped rows write the same slot and value as the first valid row (or slot 0's own value if none is valid),
    # so duplicate indices never race with different values. (index_select with a 1-element index: indexing with a
    # 0-dim tensor would read it on the host.)
    old = state.index_select(0, slot)
    S = torch.where(ok[:, None, None, None], S, old)
    j = torch.argmax(ok.to(torch.int32)).view(1)
    target = torch.where(ok, slot, slot.index_select(0, j))
    S = torch.where(ok[:, None, None, None], S, S.index_select(0, j))
    state.index_copy_(0, target, S.to(state.dtype))
    return torch.where(ok[:, None, None], o, 0.0).to(out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Public entry points


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"chunk_gated_delta_rule: q, k must be [T, H, K] and v [T, H, V], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if g.shape != q.shape and g.shape != q.shape[:2]:
        raise ValueError(f"chunk_gated_delta_rule: g must be [T, H, K] or [T, H], got {tuple(g.shape)}")
    if beta.shape != q.shape[:2]:
        raise ValueError(f"chunk_gated_delta_rule: beta must be [T, H], got {tuple(beta.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype not in _FLOATS:
            raise ValueError(f"chunk_gated_delta_rule: {name} must be a float tensor, got {t.dtype}")
    n = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None and tuple(initial_state.shape) != (n, q.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"chunk_gated_delta_rule: initial_state must be [N={n}, H, K, V], got "
                         f"{tuple(initial_state.shape)}")


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, chunk_size=64):
    """Gated delta rule over packed varlen sequences (recurrence in the module docstring).

    q, k [T, H, K]; v [T, H, V]; g [T, H, K] (per-channel log-decay, KDA) or [T, H] (per head, Gated DeltaNet),
    g <= 0; beta [T, H]; cu_seqlens int32 [N+1] or None (one sequence); initial_state fp32 [N, H, K, V] or None.
    Returns (o [T, H, V] in q's dtype, final_state fp32 [N, H, K, V] if output_final_state else None).
    Differentiable in q, k, v, g, beta and initial_state.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    supported = (q.dtype in _TRITON_FLOATS and k.dtype == q.dtype and v.dtype == q.dtype
                 and chunk_size in CHUNKS and q.shape[-1] <= MAX_DIM and v.shape[-1] <= MAX_DIM)
    if use_triton(q, k, v, g, beta, supported=supported):
        o, final = _chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
        return o, (final if output_final_state else None)
    return chunk_gated_delta_rule_native(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                         chunk_size=chunk_size)


def fused_recurrent_gated_delta_rule_step(q, k, v, g, beta, state, *, scale=None, state_indices=None):
    """One decode token per sequence: q, k [B, H, K], v [B, H, V], g [B, H, K] or [B, H], beta [B, H].

    ``state`` fp32 (or bf16: --mamba-ssm-cache-dtype; read in bf16, the math fp32, stored rounded) is updated in place:
    [B, H, K, V], or with ``state_indices`` int [B] a pool [S, H, K, V] of which row b uses slot state_indices[b] (-1:
    skipped, output 0). Fixed shapes and no host sync (CUDA-graph capturable). Returns o [B, H, V] in q's dtype. Not
    differentiable (inference only).
    """
    if state.dtype not in STEP_STATE_DTYPES:
        raise ValueError(f"fused_recurrent_gated_delta_rule_step: state must be fp32, bf16 or fp64, got {state.dtype}")
    if state_indices is None and state.shape[0] != q.shape[0]:
        raise ValueError(f"fused_recurrent_gated_delta_rule_step: state has {state.shape[0]} rows for batch "
                         f"{q.shape[0]} (pass state_indices to address a pool)")
    B, H, K = k.shape
    V = v.shape[-1]
    supported = (state.dtype in TRITON_STATE_DTYPES and state.is_contiguous() and q.dtype in _TRITON_FLOATS
                 and K <= MAX_DIM and V <= MAX_DIM)
    if use_triton(q, k, v, g, beta, state, supported=supported):
        scale = K**-0.5 if scale is None else scale
        o = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
        BK, BV = triton.next_power_of_2(K), min(32, triton.next_power_of_2(V))
        _step_kernel[(B, H, triton.cdiv(V, BV))](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state, state_indices,
            o, float(scale), H, K, V, HAS_IDX=state_indices is not None, SCALAR=g.dim() == 2, BK=BK, BV=BV,
        )  # fmt: skip
        return o
    with torch.no_grad():
        return gated_delta_rule_step_native(q, k, v, g, beta, state, scale=scale, state_indices=state_indices)


def fused_recurrent_gated_delta_rule_verify(q, k, v, g, beta, state, *, n, keep=None, scale=None, state_indices):
    """A speculative verify's ``n`` tokens per sequence through the decode step: rows ``s n .. s n + n - 1`` of q, k
    [T, H, K], v [T, H, V], g [T, H, K] or [T, H], beta [T, H] are sequence s's in order (``state_indices [B]`` its
    pool row, -1: a padding row), each token as ``fused_recurrent_gated_delta_rule_step`` computes it (the same bits),
    in one kernel that holds the state between them. With ``keep`` (a ``steps.VerifyInputs``) the pool is not
    written: k, v, g and beta are kept and ``keep.replay`` commits each sequence's accepted tokens
    (``fused_recurrent_gated_delta_rule_replay``). Without, the pool gets the state after the last. Returns o
    [T, H, V]."""
    T, H, K = k.shape
    V, B = v.shape[-1], state_indices.shape[0]
    if T != B * n:
        raise ValueError(f"fused_recurrent_gated_delta_rule_verify: {T} rows are not {B} sequences x {n} tokens")
    if keep is not None:
        keep.keep(n, lambda pool, idx, counts, n, **x: fused_recurrent_gated_delta_rule_replay(
            **x, state=pool, n=n, counts=counts, state_indices=idx), k=k, v=v, g=g, beta=beta)
    supported = (state.dtype in TRITON_STATE_DTYPES and state.is_contiguous() and q.dtype in _TRITON_FLOATS
                 and K <= MAX_DIM and V <= MAX_DIM)
    if not use_triton(q, k, v, g, beta, state, supported=supported):
        step = lambda pool, idx, *x: fused_recurrent_gated_delta_rule_step(  # noqa: E731
            *x, pool, scale=scale, state_indices=idx)
        if keep is not None:
            return step_aside(n, state, state_indices, step, q, k, v, g, beta)
        return step_through(n, state, None, state_indices, lambda *x: step(state, state_indices, *x),
                            q, k, v, g, beta)  # fmt: skip
    o = torch.empty(T, H, V, dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    BK, BV = triton.next_power_of_2(K), min(32, triton.next_power_of_2(V))  # the step kernel's tile: its bits
    _verify_kernel[(B, H, triton.cdiv(V, BV))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state, state_indices, o,
        float(K**-0.5 if scale is None else scale), H, K, V, N=n, WRITE=keep is None, SCALAR=g.dim() == 2, BK=BK,
        BV=BV,
    )  # fmt: skip
    return o


def fused_recurrent_gated_delta_rule_replay(k, v, g, beta, state, *, n, counts, state_indices) -> None:
    """Commit a verify's accepted tokens (``fused_recurrent_gated_delta_rule_verify`` with ``keep``): the first
    ``counts[b]`` (int [B], 0..n) of sequence b's ``n`` token rows of k, v, g, beta on its pool row
    ``state_indices[b]`` (-1 or a count of 0: untouched), as that many decode steps compute them, bit for bit."""
    T, H, K = k.shape
    V, B = v.shape[-1], state_indices.shape[0]
    if T != B * n or counts.shape != (B,):
        raise ValueError(f"fused_recurrent_gated_delta_rule_replay: {T} rows are not {B} sequences x {n} tokens, or "
                         f"counts {tuple(counts.shape)} is not one per sequence")
    supported = (state.dtype in TRITON_STATE_DTYPES and state.is_contiguous() and k.dtype in _TRITON_FLOATS
                 and K <= MAX_DIM and V <= MAX_DIM)
    if not use_triton(k, v, g, beta, state, supported=supported):
        replay_through(n, state_indices, counts, lambda idx, *x: fused_recurrent_gated_delta_rule_step(
            x[0], *x, state, state_indices=idx), k, v, g, beta)
        return
    if B == 0:
        return
    BK, BV = triton.next_power_of_2(K), min(32, triton.next_power_of_2(V))
    _replay_kernel[(B, H, triton.cdiv(V, BV))](
        k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state, state_indices,
        counts.to(torch.int32), H, K, V, N=n, SCALAR=g.dim() == 2, BK=BK, BV=BV,
    )  # fmt: skip
