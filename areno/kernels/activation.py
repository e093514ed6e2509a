"""SwiGLU activation: ``silu(gate) * up`` on a fused [..., 2I] gate/up projection (gate first, up second); GeGLU
(``gelu_tanh(gate) * up``, Gemma 4) on the native path only, ``gelu_tanh_and_mul``.

    a = silu(g).to(dtype)          silu(g) = g / (1 + exp(-g)), rounded as Hugging Face's act_fn output is
    y = (a * u).to(dtype)
    backward: du = dy * a;  dg = dy * u * s * (1 + g * (1 - s)),  s = sigmoid(g)

Math in fp32. One program handles BLOCK columns of one row: reads 2I, writes I elements per row (forward), reads
3I and writes 2I (backward). ``silu_and_mul_fp8`` (FP8 rollout, inference): the forward that also writes its output
quantised for the down projection's FP8 GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import as_rows, use_triton
from areno.kernels.fp8 import BLOCK as BLOCK_Q
from areno.kernels.fp8 import EPS as FP8_EPS
from areno.kernels.fp8 import FP8_MAX, cublas_act_buffers, quant_groups, quantize_act_fp8_cublas_native

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _silu_and_mul_fwd_kernel(X, Y, I, sx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * sx + I + cols, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * I + cols, (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(X, Y, Q, S, M, I, sx, stride_sm, stride_sg, Q_EPS: tl.constexpr, Q_MAX: tl.constexpr,
                             BLOCK: tl.constexpr, WRITE_Y: tl.constexpr):  # fmt: skip
    # The forward for rows < M, its output also quantised to E4M3 per 128 columns (fp8.quant_groups) into Q and S
    # (and, WRITE_Y, stored in Y); rows M .. (programs over Q's rows) are zero rows of Q. BLOCK is a multiple of 128,
    # so a program's groups are whole.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    ok = row < M
    g = tl.load(X + row * sx + cols, mask=mask & ok, other=0.0).to(tl.float32)
    u = tl.load(X + row * sx + I + cols, mask=mask & ok, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    y = (a * u).to(Y.dtype.element_ty)
    if WRITE_Y:
        tl.store(Y + row * I + cols, y, mask=mask & ok)
    codes, sc = quant_groups(tl.reshape(y.to(tl.float32), (1, BLOCK)), Q_EPS, Q_MAX, 1, BLOCK)
    tl.store(Q + row * I + cols, tl.reshape(codes, (BLOCK,)).to(Q.dtype.element_ty), mask=mask)
    grp = tl.program_id(1) * (BLOCK // 128) + tl.arange(0, BLOCK // 128)
    tl.store(S + row * stride_sm + grp * stride_sg, tl.reshape(sc, (BLOCK // 128,)), mask=grp < I // 128)


@triton.jit
def _silu_and_mul_bwd_kernel(DY, X, DX, I, sx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * sx + I + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * I + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    a = (g * s).to(DX.dtype.element_ty).to(tl.float32)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * a
    tl.store(DX + row * 2 * I + cols, dg.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * 2 * I + I + cols, du.to(DX.dtype.element_ty), mask=mask)


def _launch_shape(i: int):
    block = min(triton.next_power_of_2(i), 1024)
    return block, triton.cdiv(i, block)


def silu_and_mul_fwd(x: torch.Tensor) -> torch.Tensor:
    assert x.dtype in _FLOATS, f"silu_and_mul: x must be fp16/bf16/fp32, got {x.dtype}"
    assert x.dim() >= 1 and x.shape[-1] % 2 == 0, f"silu_and_mul: last dim must be 2 * I, got {tuple(x.shape)}"
    i = x.shape[-1] // 2
    y = torch.empty((*x.shape[:-1], i), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    x2 = as_rows(x)
    block, col_blocks = _launch_shape(i)
    _silu_and_mul_fwd_kernel[(x2.shape[0], col_blocks)](x2, y, i, x2.stride(0), BLOCK=block, num_warps=4)
    return y


def silu_and_mul_bwd(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    i = x.shape[-1] // 2
    assert dy.shape == (*x.shape[:-1], i), f"silu_and_mul backward: dy {tuple(dy.shape)} vs x {tuple(x.shape)}"
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx
    x2 = as_rows(x)
    dy = dy.contiguous()
    block, col_blocks = _launch_shape(i)
    _silu_and_mul_bwd_kernel[(x2.shape[0], col_blocks)](dy, x2, dx, i, x2.stride(0), BLOCK=block, num_warps=4)
    return dx


class SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu_and_mul_fwd(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return silu_and_mul_bwd(dy, x)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch reference, Hugging Face's ``act_fn(gate) * up``; differentiable through autograd."""
    g, u = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def silu_and_mul_fp8(x: torch.Tensor, keep_y: bool = True):
    """Inference: ``silu_and_mul(x)`` and ``act``, the output quantised for the FP8 GEMM that reads it (the MLP's
    down projection under FP8 rollout) in cuBLAS's layout (``fp8.quantize_act_fp8_cublas`` of its rows, the same
    bytes): one pass where the activation and fp8_linear's activation kernel were two. I a multiple of 128.
    ``keep_y=False``: for a consumer that reads ``act`` alone, y is only its shape's carrier, never written by the
    Triton kernel (2 I bytes a row less) and NaN on the native path (so a reader of its values shows up in tests)."""
    i = x.shape[-1] // 2
    if x.shape[-1] % 2 or i % BLOCK_Q:
        raise ValueError(f"silu_and_mul_fp8: x's last dim ({x.shape[-1]}) must be 2 I with I a multiple of {BLOCK_Q}")
    m = x.numel() // x.shape[-1]
    if not use_triton(x, supported=x.dtype in _FLOATS):
        y = silu_and_mul_native(x)
        act = quantize_act_fp8_cublas_native(y.reshape(m, i))
        return (y if keep_y else torch.full_like(y, float("nan"))), act
    y = torch.empty((*x.shape[:-1], i), dtype=x.dtype, device=x.device)
    q, sc = act = cublas_act_buffers(m, i, x.device)
    x2 = as_rows(x)
    block, col_blocks = _launch_shape(i)
    _silu_and_mul_fp8_kernel[(q.shape[0], col_blocks)](x2, y, q, sc, m, i, x2.stride(0), sc.stride(0), sc.stride(1),
                                                       Q_EPS=FP8_EPS, Q_MAX=FP8_MAX, BLOCK=block, WRITE_Y=keep_y,
                                                       num_warps=4)  # fmt: skip
    return y, act


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]``; returns ``[..., I]`` in x's dtype."""
    supported = x.dtype in _FLOATS and x.dim() >= 1 and x.shape[-1] % 2 == 0
    if use_triton(x, supported=supported):
        return SiluAndMulFunction.apply(x)
    return silu_and_mul_native(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :I]) * x[..., I:]`` (transformers' ``gelu_pytorch_tanh``), plain PyTorch ops: no Triton
    kernel yet; differentiable through autograd."""
    g, u = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(g, approximate="tanh") * u
