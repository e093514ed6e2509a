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

from areno.kernels.dispatch import use_triton

__all__ = [
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule_step", "delta_rule_reference",
    "chunk_gated_delta_rule_native", "gated_delta_rule_step_native",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SUB = 16  # sub-block rows for the intra-chunk decay factorisation


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
# Decode step


def gated_delta_rule_step_native(q, k, v, g, beta, state, *, scale=None, state_indices=None):
    """One token per sequence in PyTorch; updates ``state`` in place (rows ``state_indices``, -1 skipped) without a
    host sync, so it can be captured in a CUDA graph. Returns o [B, H, V] in q's dtype (0 for skipped rows)."""
    B, H, K = k.shape
    scale = K**-0.5 if scale is None else scale
    f, out_dtype = state.dtype, q.dtype
    q, k, v, beta = q.to(f), k.to(f), v.to(f), beta.to(f)
    gk = (g if g.dim() == 3 else g[..., None].expand(B, H, K)).to(f)
    if state_indices is None:
        S = state
    else:
        ok = state_indices >= 0
        slot = state_indices.long().clamp(min=0)
        S = state.index_select(0, slot)
    S = S * gk.exp()[..., None]
    kv = torch.einsum("bhkv,bhk->bhv", S, k)
    S = S + k[..., None] * (beta[..., None] * (v - kv))[:, :, None, :]
    o = scale * torch.einsum("bhkv,bhk->bhv", S, q)
    if state_indices is None:
        state.copy_(S)
        return o.to(out_dtype)
    # Skipped rows write the same slot and value as the first valid row (or slot 0's own value if none is valid),
    # so duplicate indices never race with different values.
    old = state.index_select(0, slot)
    S = torch.where(ok[:, None, None, None], S, old)
    j = torch.argmax(ok.to(torch.int32))
    target = torch.where(ok, slot, slot[j])
    S = torch.where(ok[:, None, None, None], S, S[j])
    state.index_copy_(0, target, S)
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
    if use_triton(q, k, v, g, beta, supported=False):
        raise NotImplementedError  # the Triton path lands in the next commit
    return chunk_gated_delta_rule_native(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                         chunk_size=chunk_size)


def fused_recurrent_gated_delta_rule_step(q, k, v, g, beta, state, *, scale=None, state_indices=None):
    """One decode token per sequence: q, k [B, H, K], v [B, H, V], g [B, H, K] or [B, H], beta [B, H].

    ``state`` fp32 is updated in place: [B, H, K, V], or with ``state_indices`` int [B] a pool [S, H, K, V] of which
    row b uses slot state_indices[b] (-1: skipped, output 0). Fixed shapes and no host sync (CUDA-graph capturable).
    Returns o [B, H, V] in q's dtype. Not differentiable (inference only).
    """
    if state.dtype != torch.float32 and state.dtype != torch.float64:
        raise ValueError(f"fused_recurrent_gated_delta_rule_step: state must be fp32, got {state.dtype}")
    if state_indices is None and state.shape[0] != q.shape[0]:
        raise ValueError(f"fused_recurrent_gated_delta_rule_step: state has {state.shape[0]} rows for batch "
                         f"{q.shape[0]} (pass state_indices to address a pool)")
    with torch.no_grad():
        return gated_delta_rule_step_native(q, k, v, g, beta, state, scale=scale, state_indices=state_indices)
