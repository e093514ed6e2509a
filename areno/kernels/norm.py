"""RMSNorm with an optional fused residual add: Triton forward/backward, native reference, autograd, dispatch.

    h = x + residual                      (optional, rounded to x's dtype as Hugging Face does)
    n = h / sqrt(mean(h^2) + eps)         (fp32)
    y = weight * n.to(h.dtype)            (the product rounded once to the output dtype)

The rounding order follows Hugging Face's Qwen3/Llama RMSNorm so bf16 outputs match it almost bit for bit.
Rows are the last dimension of any leading shape; a [T, H, D] view with strided tokens (Qwen3's per-head QK norm on
a slice of a fused projection) is read in place, without a copy.

Tiling: one program normalises a [BLOCK_M, BLOCK_N] tile of whole rows (BLOCK_N >= N), so x is read once and y
written once: 2 * M * N * bytes per element (3 reads/writes more with the residual). The backward reads x and dy,
writes dx, and reduces dweight through one fp32 partial row per program, summed afterwards.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from areno.kernels._device import sm_count
from areno.kernels.dispatch import autotune_candidates, interpreting, use_triton
from areno.kernels.fp8 import BLOCK, FP8_MAX, cublas_act_buffers, quant_groups, quantize_act_fp8_cublas_native
from areno.kernels.fp8 import EPS as FP8_EPS

MAX_N = 65536  # one row must fit one tile
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD, Q, S,
    M, N, B, sx0, sx1, sr0, sr1, eps, M_OUT, stride_sm, stride_sg,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ZERO_CENTERED: tl.constexpr = False,
    QUANT: tl.constexpr = False, Q_EPS: tl.constexpr = 1e-10, Q_MAX: tl.constexpr = 448.0,
):  # fmt: skip
    # QUANT (rms_norm_fp8): y also quantised to E4M3 per 128 columns into Q [M_OUT, N] and S (fp8.quant_groups, from
    # y rounded to its dtype, as fp8_linear's activation kernel would read it); rows M .. M_OUT (programs over
    # M_OUT rows) are zero rows of Q, the padding cuBLAS asks for.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    # Row r sits at (r // B) * s0 + (r % B) * s1: a [A, B, N] view with unit last stride.
    x_off = (rows64 // B) * sx0 + (rows64 % B) * sx1
    x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_off = (rows64 // B) * sr0 + (rows64 % B) * sr1
        r = tl.load(R + r_off[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(H + rows64[:, None] * N + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=rmask)
    n = xf * rstd[:, None]
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    if ZERO_CENTERED:  # Qwen3.5's: (n * (1 + w)) in fp32, rounded once
        y = n * (1.0 + w[None, :])
    else:
        y = n.to(X.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(Y + rows64[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if QUANT:
        yq = tl.where(rmask[:, None], y.to(Y.dtype.element_ty).to(tl.float32), 0.0)  # padding rows: +0, not w * 0
        codes, sc = quant_groups(yq, Q_EPS, Q_MAX, BLOCK_M, BLOCK_N)
        out = rows < M_OUT
        tl.store(Q + rows64[:, None] * N + cols[None, :], codes.to(Q.dtype.element_ty),
                 mask=out[:, None] & (cols < N)[None, :])
        grp = tl.arange(0, BLOCK_N // 128)
        tl.store(S + rows64[:, None] * stride_sm + grp[None, :] * stride_sg, sc,
                 mask=out[:, None] & (grp < N // 128)[None, :])


@triton.jit
def _rms_norm_bwd_kernel(
    DY, DH, X, W, RSTD, DX, DW_PART,
    M, N, B, sx0, sx1, M_BUCKET,
    HAS_DH: tl.constexpr, COMPUTE_DW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PER_SM: tl.constexpr, ZERO_CENTERED: tl.constexpr = False,
):  # fmt: skip
    # M_BUCKET (next power of two of M) and PER_SM (programs per SM, read by the grid) only key the autotuner
    # dn = dy * w;  dx = rstd * (dn - n * mean(dn * n));  dw = sum_rows dy * n.to(dtype)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    num_tiles = tl.cdiv(M, BLOCK_M)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        x_off = (rows64 // B) * sx0 + (rows64 % B) * sx1
        x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        offs = rows64[:, None] * N + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        n = x * rstd[:, None]
        if COMPUTE_DW:  # the forward's n: rounded to x's dtype before the weight, or not (zero-centred)
            dw += tl.sum(dy * (n if ZERO_CENTERED else n.to(X.dtype.element_ty).to(tl.float32)), axis=0)
        dn = dy * w[None, :]
        c = tl.sum(dn * n, axis=1) / N
        dx = rstd[:, None] * (dn - n * c[:, None])
        if HAS_DH:
            dx += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    if COMPUTE_DW:
        tl.store(DW_PART + pid.to(tl.int64) * N + cols, dw, mask=cmask)


@triton.jit
def sum_rows_kernel(X, OUT, P, n, stride_b, stride_p, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # OUT[b, cols] = sum over p of X[b, p, cols] (fp32, rows added in order), rounded to OUT's dtype
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    base = X + b.to(tl.int64) * stride_b
    for p0 in range(0, P, BLOCK_P):
        r = p0 + rows
        acc += tl.load(base + r[:, None] * stride_p + cols[None, :], mask=(r < P)[:, None] & (cols < n)[None, :],
                       other=0.0)
    tl.store(OUT + b.to(tl.int64) * n + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cols < n)


def sum_rows(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``part.sum(-2).to(dtype)`` for a backward's per-program weight-gradient partials (``[..., P, n]`` fp32, a
    few hundred rows): one launch, wide over the columns (torch's reduction over a leading dim gave Qwen3's 528 x
    1,024 partials 8 column blocks, ~9 us on the H200, plus a cast launch)."""
    lead, (p, n) = part.shape[:-2], part.shape[-2:]
    ok = part.dtype == torch.float32 and part.stride(-1) == 1 and p > 0 and n > 0
    if not use_triton(part, supported=ok):
        return part.sum(-2).to(dtype)
    flat = part.reshape(-1, p, n)
    out = torch.empty(lead + (n,), dtype=dtype, device=part.device)
    # many narrow programs (load latency, not bandwidth, bounds a 2 MB reduction): 128 rows x 8 columns a step, the
    # H200's best of a sweep (7.1 us with the launch for [528, 1024] vs torch's sum + cast 25 us, eager)
    block_p, block_n = (16, 16) if interpreting() else (128, 8)
    sum_rows_kernel[(flat.shape[0], triton.cdiv(n, block_n))](flat, out, p, n, flat.stride(0), flat.stride(1),
                                                               BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return out


def row_view(x: torch.Tensor):
    """(tensor, B, s0, s1): x seen as rows at (r // B) * s0 + (r % B) * s1 with unit last stride; copies only
    when no such view exists."""
    n = x.shape[-1]
    if x.stride(-1) == 1 or n == 1:
        if x.dim() <= 2:
            x2 = x.reshape(-1, n) if x.dim() == 1 else x
            return x2, 1, x2.stride(0), 0
        try:
            x3 = x.view(-1, x.shape[-2], n)
            if x3.stride(0) == x3.shape[1] * x3.stride(1):  # evenly spaced rows: no (i, j) split needed
                return x3, 1, x3.stride(1), 0
            return x3, x3.shape[1], x3.stride(0), x3.stride(1)
        except RuntimeError:
            pass
    x = x.contiguous()
    return x, 1, n, 0


def _tiles(m: int, n: int):
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(triton.next_power_of_2(max(m, 1)), 4096 // block_n))
    num_warps = min(16, max(4, block_m * block_n // 512))
    return block_m, block_n, num_warps



def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    assert x.dtype in _FLOATS, f"rms_norm: x must be fp16/bf16/fp32, got {x.dtype}"
    assert weight.dtype in _FLOATS, f"rms_norm: weight must be fp16/bf16/fp32, got {weight.dtype}"
    assert weight.dim() == 1 and weight.shape[0] == x.shape[-1], (
        f"rms_norm: weight must be [{x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}"
    )
    assert x.device == weight.device, f"rms_norm: x on {x.device} but weight on {weight.device}"
    assert x.shape[-1] <= MAX_N, f"rms_norm: hidden size {x.shape[-1]} > {MAX_N} is not supported by the kernel"
    if residual is not None:
        assert residual.shape == x.shape, f"rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        assert residual.dtype == x.dtype, f"rms_norm: residual dtype {residual.dtype} != x dtype {x.dtype}"
        assert residual.device == x.device, f"rms_norm: residual on {residual.device} but x on {x.device}"


def rms_norm_fwd(x, weight, eps=1e-6, residual=None, zero_centered=False, fp8_out=None):
    """Launch the forward. Returns (y, h, rstd): h is x + residual (None without residual), rstd fp32 [rows].
    ``zero_centered``: y = (n * (1 + weight)) in fp32 rounded once to x's dtype (Qwen3.5's norm). ``fp8_out``:
    ``fp8.cublas_act_buffers`` that y's E4M3 quantisation fills as well (``rms_norm_fp8``; N % 128 == 0)."""
    _check(x, weight, residual)
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    y_dtype = x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y, h, rstd
    xv, b, sx0, sx1 = row_view(x)
    if residual is not None:
        rv, rb, sr0, sr1 = row_view(residual)
        if rb != b:  # different view structure: fall back to plain rows for both
            xv, b, sx0, sx1 = x.contiguous(), 1, n, 0
            rv, sr0, sr1 = residual.contiguous(), n, 0
    else:
        rv, sr0, sr1 = xv, 0, 0
    block_m, block_n, num_warps = _tiles(m, n)
    q, sc = fp8_out if fp8_out is not None else (y, rstd)
    m_out = q.shape[0] if fp8_out is not None else m
    grid = (triton.cdiv(m_out, block_m),)
    _rms_norm_fwd_kernel[grid](
        xv, rv, weight, y, h if h is not None else y, rstd, q, sc,
        m, n, b, sx0, sx1, sr0, sr1, float(eps), m_out, sc.stride(0), sc.stride(-1),
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, ZERO_CENTERED=zero_centered,
        QUANT=fp8_out is not None, Q_EPS=FP8_EPS, Q_MAX=FP8_MAX, num_warps=num_warps,
    )  # fmt: skip
    return y, h, rstd


def rms_norm_bwd(dy, x, weight, rstd, dh=None, compute_dweight=True, zero_centered=False):
    """Launch the backward. ``x`` is the normalised input (h with a residual). Returns (dx, dweight or None)."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    assert dy.shape == x.shape, f"rms_norm backward: dy {tuple(dy.shape)} != x {tuple(x.shape)}"
    assert rstd.shape == (m,) and rstd.dtype == torch.float32, "rms_norm backward: rstd must be fp32 [rows]"
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        dw = torch.zeros_like(weight) if compute_dweight else None
        return dx, dw
    dy = dy.contiguous()
    dh = dh.contiguous() if dh is not None else None
    xv, b, sx0, sx1 = row_view(x)
    block_m, block_n, num_warps = _tiles(m, n)
    args = (dy, dh if dh is not None else dy, xv, weight, rstd, dx)
    meta = dict(HAS_DH=dh is not None, COMPUTE_DW=compute_dweight, BLOCK_N=block_n, ZERO_CENTERED=zero_centered)
    if not x.is_cuda or interpreting() or block_n > 4096:  # one tiling (the interpreter cannot autotune)
        programs = max(1, min(triton.cdiv(m, block_m), 4 * (sm_count(x.device.index or 0) if x.is_cuda else 1)))
        dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device) if compute_dweight else dx
        _rms_norm_bwd_kernel[(programs,)](*args, dw_part, m, n, b, sx0, sx1, 0, **meta, BLOCK_M=block_m, PER_SM=4,
                                          num_warps=num_warps)
    else:
        sms = sm_count(x.device.index or 0)
        progs = lambda cfg: max(1, min(triton.cdiv(m, cfg["BLOCK_M"]), cfg["PER_SM"] * sms))  # noqa: E731
        rows = max(per_sm for _, _, per_sm, _ in BWD_TILES) * sms
        dw_part = torch.empty((rows, n), dtype=torch.float32, device=x.device) if compute_dweight else dx
        tuned = tuned_bwd(block_n)
        tuned[lambda cfg: (progs(cfg),)](*args, dw_part, m, n, b, sx0, sx1, _m_bucket(m), **meta)
        programs = progs(tuned.best_config.kwargs)
    dw = sum_rows(dw_part[:programs], weight.dtype) if compute_dweight else None
    return dx, dw


# Backward tilings the autotuner times on the GPU (elements per tile, warps, programs per SM, pipeline stages):
# the persistent loop over row tiles is latency-bound at small tiles, so bigger tiles, more programs in flight and
# a pipelined loop are candidates; the first is the interpreter's / the fallback's tiling.
BWD_TILES = [(4096, 8, 4, 3), (8192, 8, 2, 3), (8192, 16, 2, 3), (16384, 16, 1, 3), (4096, 4, 8, 3),
              (2048, 4, 8, 3), (4096, 8, 4, 1), (8192, 8, 4, 2)]


def _m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 1 << 22)


@functools.cache
def tuned_bwd(block_n: int):
    """The backward autotuned over ``BWD_TILES`` for rows of ``block_n`` (BLOCK_M = tile elements / block_n),
    keyed on the row length, the row count's power of two and the gradient outputs."""
    distinct = dict.fromkeys((max(1, tile // block_n), per_sm, w, st) for tile, w, per_sm, st in BWD_TILES)
    configs = [triton.Config({"BLOCK_M": bm, "PER_SM": per_sm}, num_warps=w, num_stages=st)
               for bm, per_sm, w, st in distinct]
    return triton.autotune(configs=autotune_candidates(configs),
                           key=["N", "M_BUCKET", "HAS_DH", "COMPUTE_DW", "ZERO_CENTERED"])(
        _rms_norm_bwd_kernel)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps, zero_centered=False):
        y, h, rstd = rms_norm_fwd(x, weight, eps, residual, zero_centered)
        ctx.has_residual, ctx.zero_centered = residual is not None, zero_centered
        ctx.save_for_backward(h if h is not None else x, weight, rstd)
        return (y, h) if h is not None else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, x, weight, rstd, dh, compute_dweight=ctx.needs_input_grad[1],
                              zero_centered=ctx.zero_centered)  # fmt: skip
        # h = x + residual, so both receive the same gradient.
        return dx, dw, (dx if ctx.has_residual else None), None, None


def rms_norm_native(x, weight, eps=1e-6, residual=None, zero_centered=False):
    """Plain PyTorch reference, in Hugging Face's order; differentiable through autograd. ``zero_centered``: Qwen3.5's
    ``(n * (1 + weight))`` in fp32, rounded once to x's dtype."""
    if residual is not None:
        h = x + residual
        return rms_norm_native(h, weight, eps, zero_centered=zero_centered), h
    f = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for a float64 reference
    xf = x.to(f)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (n * (1.0 + weight.to(f))).to(x.dtype)
    return weight * n.to(x.dtype)


def _supported(x, weight, residual) -> bool:
    """What the Triton kernel takes: float dtypes, a row within one tile, the residual in x's dtype."""
    return (x.dtype in _FLOATS and weight.dtype in _FLOATS and x.shape[-1] <= MAX_N
            and (residual is None or residual.dtype == x.dtype))  # fmt: skip


def rms_norm_fp8(x, weight, eps=1e-6, residual=None, zero_centered=False):
    """Inference: ``rms_norm``'s ``y`` (and ``h`` with ``residual``, else None) plus ``act``, y quantised for the FP8
    GEMMs that read it in cuBLAS's layout (``fp8.quantize_act_fp8_cublas`` of y's rows, the same bytes): one pass
    where the norm and fp8_linear's activation kernel were two (FP8 rollout). Last dim a multiple of 128."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"rms_norm_fp8: the last dim ({x.shape[-1]}) must be a multiple of {BLOCK}")
    n = x.shape[-1]
    m = x.numel() // n
    if not use_triton(x, weight, residual, supported=_supported(x, weight, residual)):
        out = rms_norm_native(x, weight, eps, residual, zero_centered)
        y, h = out if residual is not None else (out, None)
        return y, h, quantize_act_fp8_cublas_native(y.reshape(m, n))
    act = cublas_act_buffers(m, n, x.device)
    y, h, _ = rms_norm_fwd(x, weight, eps, residual, zero_centered, fp8_out=act)
    return y, h, act


def rms_norm(x, weight, eps=1e-6, residual=None, zero_centered=False):
    """RMSNorm over the last dim of ``x``; with ``residual`` returns ``(rms_norm(x + residual), x + residual)``.
    ``zero_centered`` (Qwen3.5): the weight scales by ``1 + weight``, ``n * (1 + weight)`` in fp32 rounded once to
    x's dtype (the plain norm rounds ``n`` first, as Llama/Qwen3 do)."""
    if use_triton(x, weight, residual, supported=_supported(x, weight, residual)):
        return RMSNormFunction.apply(x, weight, residual, eps, zero_centered)
    return rms_norm_native(x, weight, eps, residual, zero_centered)
