"""Short causal depthwise convolution (the q/k/v conv of KDA, Mamba-style): Triton forward/backward, native
reference, autograd, decode update, dispatch.

Per sequence and channel d, with width W and x_s for s < 0 taken from the state (zeros if none):

    y_t[d] = act(bias[d] + sum_{j=0}^{W-1} weight[d, j] * x_{t-(W-1)+j}[d])      act = silu or identity

This is F.conv1d(x, weight[:, None], padding=W-1, groups=D)[..., :L] as transformers' ``causal_conv1d_fn`` runs it:
fp32 math, output in x's dtype. A state [N, D, W-1] holds the last W-1 inputs of a sequence in time order (state[...,
-1] is the newest); the final state of a sequence shorter than W-1 keeps the older inputs of its initial state.
x is packed varlen [T, D] with cu_seqlens int32 [N+1] (None: one sequence).
Bytes: the forward reads x once (the W-1 halo rows are re-read from cache) and writes y once: 2 * T * D * bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from areno.kernels.dispatch import interpreting, use_triton

__all__ = ["causal_conv1d", "causal_conv1d_update", "causal_conv1d_native", "causal_conv1d_update_native"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TRITON_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_ACTS = (None, "silu", "swish")


def _act(y, activation):
    return F.silu(y) if activation in ("silu", "swish") else y


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------------------
# Native reference


def causal_conv1d_native(x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None,
                         output_final_state=False):
    """Per-sequence F.conv1d in fp32 (float64 for float64 x); differentiable; host-syncs on cu_seqlens."""
    T, D = x.shape
    W = weight.shape[1]
    f = _compute_dtype(x)
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    w = weight.to(f)[:, None, :]
    b = bias.to(f) if bias is not None else None
    ys, finals = [], []
    for n in range(len(cu) - 1):
        xs = x[cu[n]:cu[n + 1]].to(f).t()  # [D, L]
        head = initial_state[n].to(f) if initial_state is not None else xs.new_zeros(D, W - 1)
        full = torch.cat([head, xs], dim=1)  # [D, W-1+L]
        y = F.conv1d(full[None], w, b, groups=D)[0]  # valid conv: L outputs
        ys.append(_act(y, activation).t())
        finals.append(full[:, full.shape[1] - (W - 1):])
    y = torch.cat(ys).to(x.dtype) if ys else x.new_zeros(0, D)
    final = torch.stack(finals) if output_final_state else None
    if final is not None and initial_state is not None:
        final = final.to(initial_state.dtype)
    elif final is not None:
        final = final.to(x.dtype)
    return y, final


def causal_conv1d_update_native(x, conv_state, weight, bias=None, *, activation="silu", state_indices=None):
    """One token per row: y [B, D]; conv_state rows (slots state_indices[b], -1 skipped) shift left and take x.
    No host sync (CUDA-graph capturable)."""
    f = _compute_dtype(x)
    if state_indices is None:
        old = conv_state
    else:
        ok = state_indices >= 0
        slot = state_indices.long().clamp(min=0)
        old = conv_state.index_select(0, slot)
    window = torch.cat([old.to(f), x.to(f)[:, :, None]], dim=-1)  # [B, D, W]
    y = (window * weight.to(f)).sum(-1)
    if bias is not None:
        y = y + bias.to(f)
    y = _act(y, activation).to(x.dtype)
    new = window[:, :, 1:].to(conv_state.dtype)
    if state_indices is None:
        conv_state.copy_(new)
        return y
    # Skipped rows rewrite the first valid row's slot with its value (or slot 0 with its own), so no write races.
    # (index_select with a 1-element index: indexing with a 0-dim tensor would read it on the host)
    new = torch.where(ok[:, None, None], new, old)
    j = torch.argmax(ok.to(torch.int32)).view(1)
    conv_state.index_copy_(0, torch.where(ok, slot, slot.index_select(0, j)),
                           torch.where(ok[:, None, None], new, new.index_select(0, j)))
    return torch.where(ok[:, None], y, 0)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels: one program per [BT tokens, BD channels] tile; the W-1 rows before a sequence's first token come
# from its initial state (or zeros). Sequence ids per token come from a searchsorted on device (no host sync).


@triton.jit
def _conv_tap(X, S0, offs_t, offs_d, tmask, dmask, seq, bos, s, D, W: tl.constexpr, HAS_S0: tl.constexpr):
    """x at rows s (per token), reading the initial state for rows before the sequence start."""
    inside = s >= bos
    val = tl.load(X + s.to(tl.int64)[:, None] * D + offs_d[None, :], mask=(tmask & inside)[:, None] & dmask[None, :],
                  other=0.0).to(tl.float32)
    if HAS_S0:
        col = (W - 1) + s - bos
        early = tmask & (~inside)
        sv = tl.load(S0 + (seq.to(tl.int64) * D)[:, None] * (W - 1) + offs_d[None, :] * (W - 1) + col[:, None],
                     mask=early[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        val += sv
    return val


@triton.jit
def _conv_kernel(X, WT, B, S0, SEQ, CU, Y, DY, DPRE, DW_PART, DB_PART, T, D,
                 W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
                 BACKWARD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Forward: y = act(bias + sum_j w_j x_{t-(W-1)+j}). Backward (BACKWARD): dpre = dy * act'(pre), stored, and
    per-program partial sums of dweight (dpre * x tap) and dbias."""
    pt, pd = tl.program_id(0), tl.program_id(1)
    offs_t = pt * BT + tl.arange(0, BT)
    offs_d = pd * BD + tl.arange(0, BD)
    tmask, dmask = offs_t < T, offs_d < D
    seq = tl.load(SEQ + offs_t, mask=tmask, other=0)
    bos = tl.load(CU + seq, mask=tmask, other=0)
    pre = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        pre += tl.load(B + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        wj = tl.load(WT + offs_d * W + j, mask=dmask, other=0.0).to(tl.float32)
        pre += wj[None, :] * _conv_tap(X, S0, offs_t, offs_d, tmask, dmask, seq, bos, offs_t - (W - 1) + j, D,
                                       W, HAS_S0)
    m2 = tmask[:, None] & dmask[None, :]
    offs = offs_t.to(tl.int64)[:, None] * D + offs_d[None, :]
    if not BACKWARD:
        y = pre * tl.sigmoid(pre) if SILU else pre
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m2)
    else:
        dy = tl.load(DY + offs, mask=m2, other=0.0).to(tl.float32)
        if SILU:
            sg = tl.sigmoid(pre)
            dy = dy * sg * (1 + pre * (1 - sg))
        tl.store(DPRE + offs, dy, mask=m2)
        part = (pt * D + offs_d) * W
        for j in tl.static_range(W):
            xj = _conv_tap(X, S0, offs_t, offs_d, tmask, dmask, seq, bos, offs_t - (W - 1) + j, D, W, HAS_S0)
            tl.store(DW_PART + part + j, tl.sum(dy * xj, axis=0), mask=dmask)
        if HAS_BIAS:
            tl.store(DB_PART + pt * D + offs_d, tl.sum(dy, axis=0), mask=dmask)


@triton.jit
def _conv_dx_kernel(DPRE, WT, SEQ, CU, DFIN, DX, T, D, W: tl.constexpr, HAS_DFIN: tl.constexpr,
                    BT: tl.constexpr, BD: tl.constexpr):
    """dx_s = sum_j w_j dpre_{s+(W-1)-j} over targets inside s's sequence, plus the final-state gradient of the
    last W-1 rows."""
    pt, pd = tl.program_id(0), tl.program_id(1)
    offs_t = pt * BT + tl.arange(0, BT)
    offs_d = pd * BD + tl.arange(0, BD)
    tmask, dmask = offs_t < T, offs_d < D
    seq = tl.load(SEQ + offs_t, mask=tmask, other=0)
    eos = tl.load(CU + seq + 1, mask=tmask, other=0)
    dx = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        tgt = offs_t + (W - 1) - j
        ok = tmask & (tgt < eos)
        wj = tl.load(WT + offs_d * W + j, mask=dmask, other=0.0).to(tl.float32)
        dp = tl.load(DPRE + tgt.to(tl.int64)[:, None] * D + offs_d[None, :], mask=ok[:, None] & dmask[None, :],
                     other=0.0)
        dx += wj[None, :] * dp
    if HAS_DFIN:
        col = offs_t - (eos - (W - 1))
        ok = tmask & (col >= 0)
        dx += tl.load(DFIN + (seq.to(tl.int64) * D)[:, None] * (W - 1) + offs_d[None, :] * (W - 1) + col[:, None],
                      mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    m2 = tmask[:, None] & dmask[None, :]
    tl.store(DX + offs_t.to(tl.int64)[:, None] * D + offs_d[None, :], dx.to(DX.dtype.element_ty), mask=m2)


@triton.jit
def _conv_state_kernel(X, S0, CU, OUT, DPRE, WT, DFIN, D, W: tl.constexpr, HAS_S0: tl.constexpr,
                       BACKWARD: tl.constexpr, HAS_DFIN: tl.constexpr, BD: tl.constexpr):
    """Per sequence and state column i (row p = bos - (W-1) + i before, or eos - (W-1) + i at the end).
    Forward: final[i] = x_{eos-(W-1)+i} (from the initial state when that row precedes bos).
    Backward: dinit[i] = sum_j w_j dpre_{p+(W-1)-j} over targets in [bos, eos) + dfinal where the final state
    still holds initial-state columns."""
    n, pd = tl.program_id(0), tl.program_id(1)
    offs_d = pd * BD + tl.arange(0, BD)
    dmask = offs_d < D
    bos, eos = tl.load(CU + n), tl.load(CU + n + 1)
    base = (n.to(tl.int64) * D + offs_d) * (W - 1)
    for i in tl.static_range(W - 1):
        if not BACKWARD:
            p = eos - (W - 1) + i
            val = tl.load(X + p.to(tl.int64) * D + offs_d, mask=dmask & (p >= bos), other=0.0).to(tl.float32)
            if HAS_S0:
                val += tl.load(S0 + base + (W - 1) + p - bos, mask=dmask & (p < bos), other=0.0).to(tl.float32)
            tl.store(OUT + base + i, val.to(OUT.dtype.element_ty), mask=dmask)
        else:
            p = bos - (W - 1) + i
            acc = tl.zeros([BD], dtype=tl.float32)
            for j in tl.static_range(W):
                tgt = p + (W - 1) - j
                ok = dmask & (tgt >= bos) & (tgt < eos)
                wj = tl.load(WT + offs_d * W + j, mask=dmask, other=0.0).to(tl.float32)
                acc += wj * tl.load(DPRE + tgt.to(tl.int64) * D + offs_d, mask=ok, other=0.0)
            if HAS_DFIN:
                col = p - (eos - (W - 1))
                acc += tl.load(DFIN + base + col, mask=dmask & (col >= 0), other=0.0).to(tl.float32)
            tl.store(OUT + base + i, acc.to(OUT.dtype.element_ty), mask=dmask)


@triton.jit
def _conv_update_kernel(X, STATE, WT, B, IDX, Y, D, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_IDX: tl.constexpr, SILU: tl.constexpr, BD: tl.constexpr):
    """Decode: y = act(bias + sum_j w_j window_j) with window = [state, x]; state <- window[1:]. Slot -1 skips."""
    b, pd = tl.program_id(0), tl.program_id(1)
    offs_d = pd * BD + tl.arange(0, BD)
    dmask = offs_d < D
    slot = tl.load(IDX + b) if HAS_IDX else b
    ok = dmask & (slot >= 0)
    base = (tl.maximum(slot, 0).to(tl.int64) * D + offs_d) * (W - 1)
    x = tl.load(X + b * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BD], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(B + offs_d, mask=dmask, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        sj = tl.load(STATE + base + j, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(WT + offs_d * W + j, mask=dmask, other=0.0).to(tl.float32) * sj
        if j > 0:
            tl.store(STATE + base + j - 1, sj.to(STATE.dtype.element_ty), mask=ok)
    acc += tl.load(WT + offs_d * W + (W - 1), mask=dmask, other=0.0).to(tl.float32) * x
    tl.store(STATE + base + (W - 2), x.to(STATE.dtype.element_ty), mask=ok)
    y = acc * tl.sigmoid(acc) if SILU else acc
    tl.store(Y + b * D + offs_d, tl.where(ok, y, 0.0).to(Y.dtype.element_ty), mask=dmask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers and autograd

INTERPRET_BLOCKS = (16, 32)  # (BT, BD) under TRITON_INTERPRET=1


def _blocks(D):
    if interpreting():
        return INTERPRET_BLOCKS
    return 32, min(128, triton.next_power_of_2(D))


def _seq_ids(cu, T):
    return (torch.searchsorted(cu[1:], torch.arange(T, device=cu.device, dtype=cu.dtype), right=True)
            .clamp_(max=cu.shape[0] - 2).to(torch.int32))


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, s0, cu, silu, out_final):
        T, D = x.shape
        W, N = weight.shape[1], cu.shape[0] - 1
        BT, BD = _blocks(D)
        seq = _seq_ids(cu, T)
        y = torch.empty_like(x)
        if T:
            _conv_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
                x, weight, bias, s0, seq, cu, y, y, y, y, y, T, D, W=W, HAS_BIAS=bias is not None,
                HAS_S0=s0 is not None, SILU=silu, BACKWARD=False, BT=BT, BD=BD,
            )  # fmt: skip
        final = None
        if out_final:
            final = torch.empty(N, D, W - 1, dtype=s0.dtype if s0 is not None else x.dtype, device=x.device)
            _conv_state_kernel[(N, triton.cdiv(D, BD))](x, s0, cu, final, x, weight, x, D, W=W, HAS_S0=s0 is not None,
                                                        BACKWARD=False, HAS_DFIN=False, BD=BD)
        ctx.save_for_backward(x, weight, bias, s0, cu, seq)
        ctx.silu = silu
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, weight, bias, s0, cu, seq = ctx.saved_tensors
        T, D = x.shape
        W, N = weight.shape[1], cu.shape[0] - 1
        BT, BD = _blocks(D)
        nt = triton.cdiv(T, BT)
        dy = dy.contiguous()
        dfinal = dfinal.contiguous() if dfinal is not None else None
        dpre = torch.empty(T, D, dtype=torch.float32, device=x.device)
        dw_part = torch.zeros(max(nt, 1), D, W, dtype=torch.float32, device=x.device)
        db_part = torch.zeros(max(nt, 1), D, dtype=torch.float32, device=x.device)
        dx = torch.empty_like(x)
        if T:
            grid = (nt, triton.cdiv(D, BD))
            _conv_kernel[grid](x, weight, bias, s0, seq, cu, x, dy, dpre, dw_part, db_part, T, D, W=W,
                               HAS_BIAS=bias is not None, HAS_S0=s0 is not None, SILU=ctx.silu, BACKWARD=True,
                               BT=BT, BD=BD)
            _conv_dx_kernel[grid](dpre, weight, seq, cu, dfinal, dx, T, D, W=W, HAS_DFIN=dfinal is not None,
                                  BT=BT, BD=BD)
        ds0 = None
        if s0 is not None:
            ds0 = torch.empty_like(s0)
            _conv_state_kernel[(N, triton.cdiv(D, BD))](x, s0, cu, ds0, dpre, weight, dfinal, D, W=W, HAS_S0=True,
                                                        BACKWARD=True, HAS_DFIN=dfinal is not None, BD=BD)
        dw = dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dw, db, ds0, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Public entry points


def _check(x, weight, bias, activation, initial_state, cu_seqlens):
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"causal_conv1d: x must be [T, D] and weight [D, W] with W >= 2, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[1],):
        raise ValueError(f"causal_conv1d: bias must be [D], got {tuple(bias.shape)}")
    if activation not in _ACTS:
        raise ValueError(f"causal_conv1d: activation must be 'silu' or None, got {activation!r}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"causal_conv1d: x must be a float tensor, got {x.dtype}")
    n = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    W = weight.shape[1]
    if initial_state is not None and tuple(initial_state.shape) != (n, x.shape[1], W - 1):
        raise ValueError(f"causal_conv1d: initial_state must be [N={n}, D, W-1={W - 1}], got "
                         f"{tuple(initial_state.shape)}")


def causal_conv1d(x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None,
                  output_final_state=False):
    """Causal depthwise conv over packed varlen x [T, D] with weight [D, W] (math in the module docstring).

    Returns (y [T, D] in x's dtype, final_state [N, D, W-1] (initial_state's dtype, else x's) or None).
    Differentiable in x, weight, bias and initial_state.
    """
    _check(x, weight, bias, activation, initial_state, cu_seqlens)
    if use_triton(x, weight, supported=x.dtype in _TRITON_FLOATS):
        cu = (cu_seqlens.to(torch.int32) if cu_seqlens is not None
              else torch.tensor([0, x.shape[0]], dtype=torch.int32, device=x.device))
        s0 = initial_state.contiguous() if initial_state is not None else None
        return _CausalConv1d.apply(x.contiguous(), weight.contiguous(), bias, s0, cu, activation is not None,
                                   output_final_state)
    return causal_conv1d_native(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                initial_state=initial_state, output_final_state=output_final_state)


def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation="silu", state_indices=None):
    """Decode step: x [B, D], conv_state [S, D, W-1] updated in place (S == B without state_indices; with
    state_indices int [B], row b uses slot state_indices[b], -1 skipped with output 0). Returns y [B, D]."""
    if x.dim() != 2 or conv_state.dim() != 3 or conv_state.shape[1:] != (x.shape[1], weight.shape[1] - 1):
        raise ValueError(f"causal_conv1d_update: x must be [B, D] and conv_state [S, D, W-1], got "
                         f"{tuple(x.shape)}, {tuple(conv_state.shape)} (weight {tuple(weight.shape)})")
    if activation not in _ACTS:
        raise ValueError(f"causal_conv1d_update: activation must be 'silu' or None, got {activation!r}")
    if state_indices is None and conv_state.shape[0] != x.shape[0]:
        raise ValueError(f"causal_conv1d_update: conv_state has {conv_state.shape[0]} rows for batch {x.shape[0]} "
                         "(pass state_indices to address a pool)")
    if use_triton(x, conv_state, weight, supported=x.dtype in _TRITON_FLOATS and conv_state.is_contiguous()):
        B, D = x.shape
        y = torch.empty_like(x)
        BD = min(256, triton.next_power_of_2(D))
        _conv_update_kernel[(B, triton.cdiv(D, BD))](
            x.contiguous(), conv_state, weight.contiguous(), bias, state_indices, y, D, W=weight.shape[1],
            HAS_BIAS=bias is not None, HAS_IDX=state_indices is not None, SILU=activation is not None, BD=BD,
        )  # fmt: skip
        return y
    with torch.no_grad():
        return causal_conv1d_update_native(x, conv_state, weight, bias, activation=activation,
                                           state_indices=state_indices)
