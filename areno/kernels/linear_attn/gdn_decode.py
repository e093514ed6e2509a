"""Qwen3.5's gated DeltaNet decode step in one kernel: from the short conv's output and the ``a``/``b`` projections to
the recurrence's output, the state updated in place.

Per sequence b and value head h (key head ``h // rep``, ``rep = nv / nk``), from ``qkv [B, 2 nk dk + nv dv]`` (the conv
output: q, k and v by heads) and ``a, b [B, nv]``:

    q, k = l2norm(q), l2norm(k)          (fp32, then rounded to the input dtype, as the layer's unfused path does)
    g    = -exp(A_log[h]) * softplus(a + dt_bias[h])      (fp32)
    beta = sigmoid(b)                    (rounded to the input dtype)
    S   <- e^g S;  S <- S + beta k (v - S^T k)^T;  o = scale S^T q

The layer's unfused decode runs these as about twenty small kernels a layer (norms, casts, the key heads' repeat,
the decay's exp/softplus, contiguous copies) around ``fused_recurrent_gated_delta_rule_step``; at Qwen3.5-9B's 24
linear-attention layers that is ~500 launches and ~2-3 ms of a 19 ms decode step at 256 rows on the H200 (profile).
Here they are one kernel that reads q/k/v/a/b once where the step kernel reads them anyway; the output's gated
RMSNorm (``gated_rms_norm_silu``: w * rmsnorm(o) * silu(z) per head, another ~9 kernels) is a second one.

Tiling as the step kernel's (``delta_rule._step_kernel``): one program per (sequence, value head, block of BV value
columns), the [K, BV] fp32 state tile in registers; each program recomputes its heads' norms (K <= 128 values).
``state_indices``: the pool row of each sequence (-1: skipped, output 0, nothing written). Inference only, no host
sync (CUDA-graph capturable). ``gdn_decode_step_native`` is the layer's unfused path (the test oracle, and the CPU's).
The gated norm also serves prefill and training (``GatedNormSilu``: its forward kernel and a backward kernel, o and
z saved in their dtype; ``gated_rms_norm_silu_native`` is the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from areno.kernels.dispatch import interpreting, use_triton
from areno.kernels.linear_attn.delta_rule import MAX_DIM, TRITON_STATE_DTYPES, gated_delta_rule_step_native, replay_tile
from areno.kernels.linear_attn.steps import replay_through, step_aside, step_through
from areno.kernels.norm import sum_rows

_TRITON_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# The step kernel's tile by state dtype: BV value columns a program (the [K, BV] fp32 state tile in registers) and
# its warps. bench/gdn_decode.py sweeps them at Qwen3.5-9B's decode shape (H100, 256 rows: fp32 BV 128 / 4 warps
# 0.403 ms = 80% of HBM, BV 32 0.438; bf16 BV 64 / 2 warps 0.216 ms).
STEP_CONFIG = {torch.float32: {"BV": 128, "num_warps": 4}, torch.bfloat16: {"BV": 64, "num_warps": 2}}


@triton.jit
def _gdn_token(row, ab, A, B_, A_LOG, DT_BIAS, S, h, kh, KD, K, V, offs_k, offs_v, kmask, vmask, scale, eps):
    """One token of one (sequence, value head, value block): S <- e^g S + beta k (v - S^T k)^T, o = scale S^T q
    (``row``: its qkv row, ``ab``: its a/b row offset); returns (S, o)."""
    dtype = row.dtype.element_ty
    q = tl.load(row + kh * K + offs_k, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(row + KD + kh * K + offs_k, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * KD + h * V + offs_v, mask=vmask, other=0.0).to(tl.float32)
    q = (q / tl.sqrt(tl.sum(q * q) + eps)).to(dtype).to(tl.float32)
    k = (k / tl.sqrt(tl.sum(k * k) + eps)).to(dtype).to(tl.float32)
    x = tl.load(A + ab + h).to(tl.float32) + tl.load(DT_BIAS + h).to(tl.float32)
    soft = tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))
    g = -tl.exp(tl.load(A_LOG + h).to(tl.float32)) * soft
    braw = tl.load(B_ + ab + h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-braw))).to(dtype).to(tl.float32)
    S = S * tl.exp(g)
    w = beta * (v - tl.sum(S * k[:, None], axis=0))
    S += k[:, None] * w[None, :]
    return S, scale * tl.sum(S * q[:, None], axis=0)


@triton.jit
def _gdn_step_kernel(QKV, stride_x, A, B_, stride_ab, A_LOG, DT_BIAS, STATE, IDX, O, scale, eps, H, REP, KD, K, V,
                     HAS_IDX: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k, offs_v = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    kmask, vmask = offs_k < K, offs_v < V
    slot = tl.load(IDX + b) if HAS_IDX else b
    ok = slot >= 0
    smask = (kmask[:, None] & vmask[None, :]) & ok
    soffs = (tl.maximum(slot, 0).to(tl.int64) * H + h) * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(STATE + soffs, mask=smask, other=0.0).to(tl.float32)
    S, o = _gdn_token(QKV + b.to(tl.int64) * stride_x, b.to(tl.int64) * stride_ab, A, B_, A_LOG, DT_BIAS, S, h,
                      h // REP, KD, K, V, offs_k, offs_v, kmask, vmask, scale, eps)  # fmt: skip
    tl.store(STATE + soffs, S.to(STATE.dtype.element_ty), mask=smask)
    tl.store(O + (b.to(tl.int64) * H + h) * V + offs_v, tl.where(ok, o, 0.0).to(O.dtype.element_ty), mask=vmask)


@triton.jit
def _gdn_verify_kernel(QKV, stride_x, A, B_, stride_ab, A_LOG, DT_BIAS, STATE, IDX, O, scale, eps, H, REP, KD, K, V,
                       N: tl.constexpr, WRITE: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """A verify's N tokens of sequence b (rows b N .. b N + N - 1) on its state, held in registers between them
    (rounded to the pool's dtype, as the step kernel's store and reload round it). ``WRITE``: the state after the
    last to the pool; else nothing is written but the outputs (the replay commits the accepted tokens,
    ``_gdn_replay_kernel``)."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k, offs_v = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    kmask, vmask = offs_k < K, offs_v < V
    slot = tl.load(IDX + b)
    ok = slot >= 0
    smask = (kmask[:, None] & vmask[None, :]) & ok
    soffs = tl.maximum(slot, 0).to(tl.int64) * H * K * V + h * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(STATE + soffs, mask=smask, other=0.0).to(tl.float32)
    for i in tl.static_range(N):
        t = b.to(tl.int64) * N + i
        S, o = _gdn_token(QKV + t * stride_x, t * stride_ab, A, B_, A_LOG, DT_BIAS, S, h, h // REP, KD, K, V,
                          offs_k, offs_v, kmask, vmask, scale, eps)  # fmt: skip
        tl.store(O + (t * H + h) * V + offs_v, tl.where(ok, o, 0.0).to(O.dtype.element_ty), mask=vmask)
        if i < N - 1:
            S = S.to(STATE.dtype.element_ty).to(tl.float32)
    if WRITE:
        tl.store(STATE + soffs, S.to(STATE.dtype.element_ty), mask=smask)


@triton.jit
def _gdn_replay_kernel(QKV, stride_x, A, B_, stride_ab, A_LOG, DT_BIAS, STATE, IDX, CNT, eps, H, REP, KD, K, V,
                       N: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """The first CNT[b] of sequence b's N kept verify tokens on its state (read once, written once; rounded to the
    pool's dtype after each token, as the step kernel's store rounds it: the same bits as stepping)."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    S, soffs, smask, cnt, offs_k, offs_v, kmask, vmask = replay_tile(STATE, IDX, CNT, b, h, vb, H, K, V, BK, BV)
    for i in tl.static_range(N):
        if i < cnt:  # a branch, not a select: one state tile in registers
            t = b.to(tl.int64) * N + i
            S, _ = _gdn_token(QKV + t * stride_x, t * stride_ab, A, B_, A_LOG, DT_BIAS, S, h, h // REP, KD, K, V,
                              offs_k, offs_v, kmask, vmask, 1.0, eps)  # fmt: skip
            S = S.to(STATE.dtype.element_ty).to(tl.float32)
    tl.store(STATE + soffs, S.to(STATE.dtype.element_ty), mask=smask)


# The decode kernels sharing STEP_CONFIG's tile, by name: bench/kernel_resources.py compiles them for a GPU target
# offline (registers and spills per tile).
TILED_KERNELS = {"gdn_step": _gdn_step_kernel, "gdn_verify": _gdn_verify_kernel, "gdn_replay": _gdn_replay_kernel}


@triton.jit
def _gated_norm_kernel(O, Z, W, OUT, stride_z, eps, H, V, ROUND_WN: tl.constexpr, BV: tl.constexpr):
    r = tl.program_id(0)  # one (token, head) row
    t, h = r // H, r % H
    dtype = O.dtype.element_ty
    offs = tl.arange(0, BV)
    m = offs < V
    o = tl.load(O + r.to(tl.int64) * V + offs, mask=m, other=0.0).to(tl.float32)
    z = tl.load(Z + t.to(tl.int64) * stride_z + h * V + offs, mask=m, other=0.0).to(tl.float32)
    n = (o / tl.sqrt(tl.sum(o * o) / V + eps)).to(dtype).to(tl.float32)
    wn = tl.load(W + offs, mask=m, other=0.0).to(tl.float32) * n
    if ROUND_WN:  # weight and n of one low-precision dtype: torch multiplies them in it
        wn = wn.to(dtype).to(tl.float32)
    tl.store(OUT + r.to(tl.int64) * V + offs, (wn * z / (1.0 + tl.exp(-z))).to(dtype), mask=m)


def gated_rms_norm_silu_native(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * rmsnorm(o) * silu(z)`` over the head dim (normalised in fp32, rounded as transformers does): the layer's
    output norm (autograd through it in training)."""
    of = o.float()
    n = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return (weight * n * F.silu(z.float())).to(o.dtype)


@triton.jit
def _gated_norm_bwd_kernel(O, Z, W, DY, DO, DZ, DW_PART, stride_z, eps, R, H, V, ROWS: tl.constexpr,
                           BV: tl.constexpr):  # fmt: skip
    """``ROWS`` (token, head) rows a program: do, dz (fp32 math, stored in o's dtype) and this program's partial
    dweight (fp32). y = w n s with n = o rstd, s = silu(z): dz = dy w n silu'(z); dn = dy s w;
    do = rstd (dn - n mean(dn n)); dw = sum dy s n."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BV)
    m = offs < V
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    dw = tl.zeros([BV], dtype=tl.float32)
    for i in range(ROWS):
        r = pid * ROWS + i
        if r < R:
            t, h = r // H, r % H
            o = tl.load(O + r.to(tl.int64) * V + offs, mask=m, other=0.0).to(tl.float32)
            z = tl.load(Z + t.to(tl.int64) * stride_z + h * V + offs, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + r.to(tl.int64) * V + offs, mask=m, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(o * o) / V + eps)
            n = o * rstd
            sig = 1.0 / (1.0 + tl.exp(-z))
            s = z * sig
            dz = dy * w * n * sig * (1.0 + z * (1.0 - sig))
            dn = dy * s * w
            do = rstd * (dn - n * (tl.sum(dn * n) / V))
            dw += dy * s * n
            tl.store(DO + r.to(tl.int64) * V + offs, do.to(DO.dtype.element_ty), mask=m)
            tl.store(DZ + r.to(tl.int64) * V + offs, dz.to(DZ.dtype.element_ty), mask=m)
    tl.store(DW_PART + pid.to(tl.int64) * V + offs, dw, mask=m)


def _gated_norm_fwd(o, z, weight, eps):
    T, H, V = o.shape
    out = torch.empty_like(o)
    if T:
        round_wn = weight.dtype == o.dtype and o.dtype != torch.float32
        _gated_norm_kernel[(T * H,)](o, z, weight, out, z.stride(0), float(eps), H, V, ROUND_WN=round_wn,
                                     BV=triton.next_power_of_2(V))  # fmt: skip
    return out


class GatedNormSilu(torch.autograd.Function):
    """The output norm with its gradients in two kernels (training): the forward saves o and z in their dtype (the
    native composition kept ~16 bytes of fp32 and bf16 intermediates an element for its backward)."""

    @staticmethod
    def forward(ctx, o, z, weight, eps):
        ctx.save_for_backward(o, z, weight)
        ctx.eps = eps
        return _gated_norm_fwd(o, z, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        o, z, weight = ctx.saved_tensors
        T, H, V = o.shape
        do, dz = torch.empty_like(o), torch.empty_like(o)  # z has o's dtype (supported) and gets a contiguous grad
        rows_each = 16 if not interpreting() else 2
        programs = max(1, triton.cdiv(T * H, rows_each))
        part = torch.empty(programs, V, dtype=torch.float32, device=o.device)
        if T:
            _gated_norm_bwd_kernel[(programs,)](o, z, weight, dy.contiguous(), do, dz, part, z.stride(0),
                                                float(ctx.eps), T * H, H, V, ROWS=rows_each,
                                                BV=triton.next_power_of_2(V))  # fmt: skip
        else:
            part.zero_()
        dw = sum_rows(part, weight.dtype) if ctx.needs_input_grad[2] else None
        return do, dz, dw, None


def gated_rms_norm_silu(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The output norm of ``o [T, H, V]`` (contiguous) gated by ``z [T, H, V]`` (unit last stride, rows of any
    stride): one kernel where it can run (with gradients: ``GatedNormSilu``, a backward kernel), else the native
    path."""
    T, H, V = o.shape
    supported = (o.is_contiguous() and z.stride(2) == 1 and z.stride(1) == V and o.dtype in _TRITON_FLOATS
                 and z.dtype == o.dtype and V <= 1024)
    if not use_triton(o, z, weight, supported=supported):
        return gated_rms_norm_silu_native(o, z, weight, eps)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (o, z, weight)):
        return GatedNormSilu.apply(o, z, weight, float(eps))
    return _gated_norm_fwd(o, z, weight, eps)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum x^2 + eps)`` over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_inputs(qkv, a, b, A_log, dt_bias, *, num_k_heads, num_v_heads, head_k_dim, eps=1e-6):
    """The recurrence's inputs from the conv output ``qkv [T, 2 nk dk + nv dv]`` and ``a, b [T, nv]``, as the
    layer computes them (differentiable): q, k ``[T, nv, dk]`` L2-normed in fp32 and rounded to qkv's dtype, each
    key head repeated for its value heads; v ``[T, nv, dv]``; g = -exp(A_log) softplus(a + dt_bias) and beta =
    sigmoid(b), fp32 ``[T, nv]``."""
    nk, nv, dk = num_k_heads, num_v_heads, head_k_dim
    T, kd = qkv.shape[0], nk * dk
    q, k, v = qkv.split([kd, kd, qkv.shape[1] - 2 * kd], dim=-1)
    q, k = (l2norm(x.reshape(T, nk, dk), eps).to(qkv.dtype) for x in (q, k))
    if nv != nk:  # each key head's value heads (repeat_interleave's values, no host read under capture)
        q, k = (x.unsqueeze(2).expand(T, nk, nv // nk, dk).reshape(T, nv, dk) for x in (q, k))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return q, k, v.reshape(T, nv, -1), g, torch.sigmoid(b).float()


def gdn_decode_step_native(qkv, a, b, A_log, dt_bias, state, *, num_k_heads, num_v_heads, scale=None,
                           state_indices=None, eps=1e-6):
    """The layer's unfused decode in PyTorch (see the module docstring): returns o ``[B, nv, dv]`` in qkv's dtype."""
    q, k, v, g, beta = gdn_inputs(qkv, a, b, A_log, dt_bias, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
                                  head_k_dim=state.shape[-2], eps=eps)
    return gated_delta_rule_step_native(q, k, v, g, beta, state, scale=scale, state_indices=state_indices)


def _check(name, qkv, a, b, state, nk, nv) -> None:
    T, K, V = qkv.shape[0], state.shape[-2], state.shape[-1]
    if qkv.shape[1] != 2 * nk * K + nv * V or a.shape != (T, nv) or b.shape != (T, nv) or state.shape[1] != nv:
        raise ValueError(f"{name}: qkv {tuple(qkv.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, state "
                         f"{tuple(state.shape)} do not fit {nk} key / {nv} value heads")
    if nv % nk:
        raise ValueError(f"{name}: {nv} value heads are not a multiple of {nk} key heads")


def gdn_decode_step(qkv, a, b, A_log, dt_bias, state, *, num_k_heads, num_v_heads, scale=None, state_indices=None,
                    eps=1e-6):
    """One decode token per sequence of a gated DeltaNet layer: ``qkv [B, 2 nk dk + nv dv]`` (the conv output, unit
    last stride), ``a, b [B, nv]`` (unit last stride), ``A_log, dt_bias [nv]``, ``state`` fp32 ``[S, nv, dk, dv]``
    updated in place (rows ``state_indices``, or ``[B, ...]`` without; bf16 states are read and written in bf16, the
    math in fp32). Returns o ``[B, nv, dv]`` in qkv's dtype."""
    nk, nv = num_k_heads, num_v_heads
    B, K, V = qkv.shape[0], state.shape[-2], state.shape[-1]
    _check("gdn_decode_step", qkv, a, b, state, nk, nv)
    supported = (state.dtype in TRITON_STATE_DTYPES and state.is_contiguous() and qkv.dtype in _TRITON_FLOATS
                 and K <= MAX_DIM and V <= MAX_DIM and qkv.stride(1) == 1 and a.stride(1) == 1
                 and a.stride() == b.stride())
    scale = K**-0.5 if scale is None else scale
    if not use_triton(qkv, a, b, state, supported=supported):
        with torch.no_grad():
            return gdn_decode_step_native(qkv, a, b, A_log, dt_bias, state, num_k_heads=nk, num_v_heads=nv,
                                          scale=scale, state_indices=state_indices, eps=eps)
    o = torch.empty(B, nv, V, dtype=qkv.dtype, device=qkv.device)
    if B == 0:
        return o
    cfg = STEP_CONFIG[state.dtype]
    BK, BV = triton.next_power_of_2(K), min(cfg["BV"], triton.next_power_of_2(V))
    _gdn_step_kernel[(B, nv, triton.cdiv(V, BV))](
        qkv, qkv.stride(0), a, b, a.stride(0), A_log, dt_bias, state, state_indices, o, float(scale), float(eps),
        nv, nv // nk, nk * K, K, V, HAS_IDX=state_indices is not None, BK=BK, BV=BV,
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return o


def gdn_verify_steps(qkv, a, b, A_log, dt_bias, state, *, n, keep=None, num_k_heads, num_v_heads, scale=None,
                     state_indices, eps=1e-6):
    """A speculative verify's ``n`` tokens per sequence through the decode step: rows ``s n .. s n + n - 1`` of
    ``qkv``, ``a`` and ``b`` are sequence s's in order (``state_indices [B]`` its pool row, -1: a padding row), each
    token computed as ``gdn_decode_step`` computes it (the same tile, the same bits), the state held between them.
    Returns o ``[B n, nv, dv]``.

    With ``keep`` (a ``steps.VerifyInputs``: the engine's) the pool is not written: the tokens' inputs are kept and
    ``keep.replay`` commits each sequence's accepted ones (``gdn_replay``), each state read twice and written once.
    Without, the pool gets the state after the last token (read once, written once). Elsewhere (the CPU,
    unsupported layouts): the step kernel n times (on a copy of the states, with ``keep``)."""
    nk, nv = num_k_heads, num_v_heads
    T, K, V = qkv.shape[0], state.shape[-2], state.shape[-1]
    B = state_indices.shape[0]
    _check("gdn_verify_steps", qkv, a, b, state, nk, nv)
    if T != B * n:
        raise ValueError(f"gdn_verify_steps: {T} rows are not {B} sequences x {n} tokens")
    scale = K**-0.5 if scale is None else scale
    kw = dict(num_k_heads=nk, num_v_heads=nv, scale=scale, eps=eps)
    if keep is not None:
        keep.keep(n, lambda pool, idx, counts, n, qkv, a, b: gdn_replay(
            qkv, a, b, A_log, dt_bias, pool, n=n, counts=counts, state_indices=idx, **kw), qkv=qkv, a=a, b=b)
    supported = (state.dtype in TRITON_STATE_DTYPES and state.is_contiguous() and qkv.dtype in _TRITON_FLOATS
                 and K <= MAX_DIM and V <= MAX_DIM and qkv.stride(1) == 1 and a.stride(1) == 1
                 and a.stride() == b.stride())
    if not use_triton(qkv, a, b, state, supported=supported):
        step = lambda pool, idx, x, ai, bi: gdn_decode_step(x, ai, bi, A_log, dt_bias, pool, state_indices=idx,  # noqa
                                                            **kw)
        if keep is not None:
            return step_aside(n, state, state_indices, step, qkv, a, b)
        return step_through(n, state, None, state_indices, lambda *x: step(state, state_indices, *x), qkv, a, b)
    o = torch.empty(T, nv, V, dtype=qkv.dtype, device=qkv.device)
    if B == 0:
        return o
    cfg = STEP_CONFIG[state.dtype]  # the step kernel's tile: the same reductions, the same bits
    BK, BV = triton.next_power_of_2(K), min(cfg["BV"], triton.next_power_of_2(V))
    _gdn_verify_kernel[(B, nv, triton.cdiv(V, BV))](
        qkv, qkv.stride(0), a, b, a.stride(0), A_log, dt_bias, state, state_indices, o, float(scale), float(eps), nv,
        nv // nk, nk * K, K, V, N=n, WRITE=keep is None, BK=BK, BV=BV, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return o


def gdn_replay(qkv, a, b, A_log, dt_bias, state, *, n, counts, state_indices, num_k_heads, num_v_heads, scale=None,
               eps=1e-6) -> None:
    """Commit a verify's accepted tokens (``gdn_verify_steps`` with ``keep``): the first ``counts[b]`` (int32 [B],
    0..n) of sequence b's ``n`` token rows of ``qkv``, ``a``, ``b`` on its pool row ``state_indices[b]`` (-1 or a
    count of 0: untouched), as that many decode steps compute them, bit for bit; one read and one write a state."""
    nk, nv = num_k_heads, num_v_heads
    T, K, V = qkv.shape[0], state.shape[-2], state.shape[-1]
    B = state_indices.shape[0]
    _check("gdn_replay", qkv, a, b, state, nk, nv)
    if T != B * n or counts.shape != (B,):
        raise ValueError(f"gdn_replay: {T} rows are not {B} sequences x {n} tokens, or counts {tuple(counts.shape)}"
                         f" is not one per sequence")
    supported = (state.dtype in TRITON_STATE_DTYPES and state.is_contiguous() and qkv.dtype in _TRITON_FLOATS
                 and K <= MAX_DIM and V <= MAX_DIM and qkv.stride(1) == 1 and a.stride(1) == 1
                 and a.stride() == b.stride())
    kw = dict(num_k_heads=nk, num_v_heads=nv, scale=scale, eps=eps)
    if not use_triton(qkv, a, b, state, supported=supported):
        replay_through(n, state_indices, counts, lambda idx, x, ai, bi: gdn_decode_step(
            x, ai, bi, A_log, dt_bias, state, state_indices=idx, **kw), qkv, a, b)
        return
    if B == 0:
        return
    cfg = STEP_CONFIG[state.dtype]
    BK, BV = triton.next_power_of_2(K), min(cfg["BV"], triton.next_power_of_2(V))
    _gdn_replay_kernel[(B, nv, triton.cdiv(V, BV))](
        qkv, qkv.stride(0), a, b, a.stride(0), A_log, dt_bias, state, state_indices, counts.to(torch.int32),
        float(eps), nv, nv // nk, nk * K, K, V, N=n, BK=BK, BV=BV, num_warps=cfg["num_warps"],
    )  # fmt: skip
