"""NF4 weights (QLoRA's 4-bit NormalFloat, bitsandbytes' format): quantise, dequantise, and a Triton GEMM that
dequantises the weight in its prologue; native PyTorch reference, autograd for the input gradient, dispatch.

Format (bitsandbytes' ``quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")``, what PEFT's
QLoRA users load): the weight ``W [N, K]`` is read flat (row-major, element ``i = n K + k``) in blocks of 64.

    absmax[b]   = max |w| over block b                                   (fp32)
    code(i)     = the NF4 value nearest to w[i] / absmax[b]   (16 values, midpoints split ties downward)
    packed[i/2] = code(2j) << 4 | code(2j + 1)                (uint8: the even element in the high nibble)
  double quantisation of the scales (one fp32 offset, blocks of 256 absmax values):
    offset      = mean(absmax)
    absmax2[c]  = max |absmax - offset| over block c of 256                (fp32)
    qabs[b]     = the 8-bit dynamic-map entry nearest to (absmax[b] - offset) / absmax2[c]       (uint8)
  dequantised:  w'[i] = NF4[code(i)] * (DYNAMIC[qabs[b]] * absmax2[c] + offset), all in fp32, then the model dtype.

Storage per weight element: 0.5 byte + 1/64 byte (qabs) + 4/16384 byte (absmax2) = 0.516 byte, vs 2 in bf16.

GEMM ``y = x W'^T`` (``x [M, K]``, fp32 accumulation, ``y`` in x's dtype): program (i, j) owns a ``[BLOCK_M, BLOCK_P]``
tile of the output and walks the reduction in ``BLOCK_R`` steps; each step loads the packed bytes of its weight tile,
picks the nibble, looks the code and the block's doubly quantised scale up (16- and 256-entry tables, L1-resident),
rounds the dequantised tile to x's dtype (as the native path rounds W') and feeds ``tl.dot``. The same kernel with
``TRANS`` computes the input gradient ``dx = dy W'`` (reduction over N): the base weight has no gradient, x does (the
LoRA layers below it train). Bytes read per GEMM: 0.52 N K for the weight (vs 2 N K for bf16) plus the activations.
From ``DEQUANT_MIN_M`` rows (prefill, training) a one-pass Triton dequantisation writes W' in x's dtype and
``torch.matmul`` multiplies (bitsandbytes' training path): the GEMM's work dwarfs the pass there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from areno.kernels.dispatch import as_rows, interpreting, use_triton

BLOCKSIZE = 64  # elements per absmax
BLOCKSIZE2 = 256  # absmax values per second-level scale
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# The 16 NF4 levels (QLoRA, appendix E; bitsandbytes' get_4bit_type("nf4")): quantiles of N(0, 1) scaled to [-1, 1]
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


class Nf4Weight(NamedTuple):
    """A quantised ``[N, K]`` weight: ``packed`` uint8 ``[ceil(N K / 2)]``, ``qabs`` uint8 ``[nblocks]``, ``absmax2``
    fp32 ``[ceil(nblocks / 256)]``, ``offset`` fp32 0-d (a tensor: no host sync), ``shape`` ``(N, K)``."""

    packed: torch.Tensor
    qabs: torch.Tensor
    absmax2: torch.Tensor
    offset: torch.Tensor
    shape: tuple

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.qabs, self.absmax2, self.offset))


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map()``: 7 exponent bits), 256 sorted fp32 values:
    for each decade 10^(e-6), e = 0..6, the midpoints of 2^e + 1 points spaced evenly over [0.1, 1], both signs;
    then 0 and 1."""
    values = []
    for e in range(7):
        points = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        mids = (points[:-1] + points[1:]) / 2.0
        values += (10 ** (e - 6) * mids).tolist() + (-(10 ** (e - 6)) * mids).tolist()  # fp32 products
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The NF4 and dynamic-map lookup tables (fp32) on ``device``, made once."""
    return torch.tensor(NF4, dtype=torch.float32, device=device), dynamic_map().to(device)


def _blockwise(flat: torch.Tensor, code: torch.Tensor, block: int, even: bool = False):
    """Nearest-``code`` indices of ``flat / absmax`` per ``block`` elements (a short last block divides, the full
    ones multiply by the reciprocal, as bitsandbytes), and the absmax; ``even`` pads the scaled values with a 0 to
    an even count first (two codes a byte)."""
    n = flat.numel()
    full = n - n % block
    blocks = flat[:full].view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1).reshape(-1)
    if full < n:
        last = flat[full:].abs().amax().clamp(min=1e-38)
        absmax = torch.cat([absmax, last[None]])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / last, -1, 1)])
    if even and n % 2:
        scaled = F.pad(scaled, (0, 1))
    idx = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True)
    return idx.to(torch.uint8), absmax


def quantize_nf4(w: torch.Tensor) -> Nf4Weight:
    """``w [N, K]`` (any float dtype) as NF4 with double-quantised scales (bitsandbytes' bytes)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"nf4: a 2-D float weight expected, got {w.dtype} {tuple(w.shape)}")
    code, code2 = tables(str(w.device))
    idx, absmax = _blockwise(w.detach().reshape(-1).float(), code, BLOCKSIZE, even=True)
    packed = (idx[0::2] << 4) | idx[1::2]
    offset = absmax.mean()
    qabs, absmax2 = _blockwise(absmax - offset, code2, BLOCKSIZE2)
    return Nf4Weight(packed, qabs, absmax2, offset, tuple(w.shape))


def block_scales(q: Nf4Weight) -> torch.Tensor:
    """The fp32 absmax of every 64-block, as the double quantisation gives it back."""
    _, code2 = tables(str(q.packed.device))
    second = q.absmax2.repeat_interleave(BLOCKSIZE2)[: q.qabs.numel()]
    return code2[q.qabs.long()] * second + q.offset


def dequantize_nf4(q: Nf4Weight, dtype=torch.float32) -> torch.Tensor:
    """``[N, K]`` in ``dtype`` (computed in fp32, as bitsandbytes' ``dequantize_4bit``)."""
    code, _ = tables(str(q.packed.device))
    n = q.shape[0] * q.shape[1]
    nib = torch.stack([q.packed >> 4, q.packed & 0x0F], dim=1).reshape(-1)[:n].long()
    scale = block_scales(q).repeat_interleave(BLOCKSIZE)[:n]
    return (code[nib] * scale).view(q.shape).to(dtype)


# ---------------------------------------------------------------------------------------------- Triton kernel


@triton.jit
def _nf4_matmul_kernel(a_ptr, q_ptr, qabs_ptr, abs2_ptr, off_ptr, code_ptr, code2_ptr, out_ptr,
                       M, P, R, K, stride_am, stride_om,
                       TRANS: tl.constexpr, DOT_PREC: tl.constexpr, BLOCKSIZE: tl.constexpr,
                       BLOCKSIZE2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_R: tl.constexpr):  # fmt: skip
    # out [M, P] = a [M, R] @ B [R, P], B[r, p] = W'[p, r] (forward: P = N, R = K) or W'[r, p] (TRANS, dx: P = K,
    # R = N); W' [N, K] dequantised on the fly from element n K + k of the packed stream.
    pid_m = tl.program_id(0)
    pid_p = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    m_ok = offs_m < M
    p_ok = offs_p < P
    offset = tl.load(off_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        a = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_r[None, :],
                    mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        if TRANS:
            flat = offs_r.to(tl.int64)[:, None] * K + offs_p[None, :]
        else:
            flat = offs_p.to(tl.int64)[None, :] * K + offs_r[:, None]
        w_ok = r_ok[:, None] & p_ok[None, :]
        byte = tl.load(q_ptr + flat // 2, mask=w_ok, other=0).to(tl.int32)
        nib = (byte >> ((1 - (flat % 2)) * 4).to(tl.int32)) & 0xF
        blk = flat // BLOCKSIZE
        qa = tl.load(qabs_ptr + blk, mask=w_ok, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + qa) * tl.load(abs2_ptr + blk // BLOCKSIZE2, mask=w_ok, other=0.0) + offset
        w = tl.where(w_ok, tl.load(code_ptr + nib) * scale, 0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PREC)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_p[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & p_ok[None, :])


@triton.jit
def _nf4_dequant_kernel(q_ptr, qabs_ptr, abs2_ptr, off_ptr, code_ptr, code2_ptr, out_ptr, n,
                        BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # W' flat [n] in out's dtype: element i from packed byte i // 2 and block i // BLOCKSIZE's scale, in fp32.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    byte = tl.load(q_ptr + i // 2, mask=ok, other=0).to(tl.int32)
    nib = (byte >> ((1 - (i % 2)) * 4).to(tl.int32)) & 0xF
    blk = i // BLOCKSIZE
    qa = tl.load(qabs_ptr + blk, mask=ok, other=0).to(tl.int32)
    scale = tl.load(code2_ptr + qa) * tl.load(abs2_ptr + blk // BLOCKSIZE2, mask=ok, other=0.0) + tl.load(off_ptr)
    tl.store(out_ptr + i, (tl.load(code_ptr + nib) * scale).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_nf4_triton(q: Nf4Weight, dtype=torch.bfloat16) -> torch.Tensor:
    """``dequantize_nf4`` in one Triton pass (the same fp32 arithmetic): reads 0.52 bytes a weight, writes W'."""
    code, code2 = tables(str(q.packed.device))
    n = q.shape[0] * q.shape[1]
    out = torch.empty(q.shape, dtype=dtype, device=q.packed.device)
    block = 256 if interpreting() else 2048
    if n:
        _nf4_dequant_kernel[(triton.cdiv(n, block),)](q.packed, q.qabs, q.absmax2, q.offset, code, code2, out, n,
                                                      BLOCKSIZE=BLOCKSIZE, BLOCKSIZE2=BLOCKSIZE2, BLOCK=block)
    return out


# From this many rows nf4_matmul dequantises W' once (0.52 bytes read and 2 written a weight) and multiplies with
# cuBLAS / torch.matmul, as bitsandbytes does for training: a [M, N K] GEMM's work then dwarfs the extra pass, and
# the fused prologue's gathers (byte, code, two scale levels a tile) cost more than they save. Fewer rows (decode
# steps) keep the fused GEMM, which reads the weight in 0.52 bytes and nothing else.
DEQUANT_MIN_M = 128


def _config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_P, BLOCK_R, num_warps, num_stages) of the fused GEMM (m < DEQUANT_MIN_M): small tiles in the
    interpreter (speed), else by M."""
    if interpreting():
        return 16, 32, 32, 1, 1
    if m <= 16:
        return 16, 64, 128, 4, 3
    return 64, 64, 64, 4, 3


def nf4_matmul(a: torch.Tensor, q: Nf4Weight, trans: bool = False, _path: str = "auto") -> torch.Tensor:
    """Triton: ``a [M, K] @ W'^T -> [M, N]``, or with ``trans`` ``a [M, N] @ W' -> [M, K]``, fp32 accumulation
    (from ``DEQUANT_MIN_M`` rows: W' dequantised in x's dtype, then ``torch.matmul``; ``_path`` "fused" /
    "dequant" pins one way, for bench/nf4_gemm.py)."""
    n, k = q.shape
    p, r = (k, n) if trans else (n, k)
    assert a.dim() == 2 and a.shape[1] == r and a.stride(1) == 1, f"nf4: a [M, {r}] expected, got {tuple(a.shape)}"
    m = a.shape[0]
    if _path not in ("auto", "fused", "dequant"):
        raise ValueError(f"nf4_matmul: _path must be auto, fused or dequant, got {_path!r}")
    if _path == "dequant" or (_path == "auto" and m >= DEQUANT_MIN_M):
        w = dequantize_nf4_triton(q, a.dtype)
        return a @ w if trans else a @ w.t()
    out = torch.empty(m, p, dtype=a.dtype, device=a.device)
    if m == 0 or p == 0:
        return out
    code, code2 = tables(str(a.device))
    bm, bp, br, warps, stages = _config(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(p, bp))
    _nf4_matmul_kernel[grid](a, q.packed, q.qabs, q.absmax2, q.offset, code, code2, out, m, p, r, k,
                             a.stride(0), out.stride(0), TRANS=trans,
                             DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32", BLOCKSIZE=BLOCKSIZE,
                             BLOCKSIZE2=BLOCKSIZE2, BLOCK_M=bm, BLOCK_P=bp, BLOCK_R=br,
                             num_warps=warps, num_stages=stages)  # fmt: skip
    return out


class Nf4LinearFunction(torch.autograd.Function):
    """``x W'^T`` through the Triton GEMM; the backward gives x's gradient only (the quantised base is frozen)."""

    @staticmethod
    def forward(ctx, x, packed, qabs, absmax2, offset, shape):
        q = Nf4Weight(packed, qabs, absmax2, offset, shape)
        ctx.save_for_backward(packed, qabs, absmax2, offset)
        ctx.shape = shape
        return nf4_matmul(x, q)

    @staticmethod
    def backward(ctx, dy):
        dx = None
        if ctx.needs_input_grad[0]:
            dx = nf4_matmul(dy.contiguous(), Nf4Weight(*ctx.saved_tensors, ctx.shape), trans=True)
        return dx, None, None, None, None, None


def nf4_linear_native(x: torch.Tensor, q: Nf4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: dequantise to x's dtype, then ``F.linear`` (autograd gives x's gradient)."""
    return F.linear(x, dequantize_nf4(q, x.dtype), bias)


def nf4_linear(x: torch.Tensor, q: Nf4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W'^T (+ bias) -> [..., N]``: the Triton GEMM with the NF4 prologue, or the native reference."""
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"nf4_linear: x's last dim is {x.shape[-1]}, the weight is {tuple(q.shape)}")
    if not use_triton(x, q.packed, supported=x.dtype in _FLOATS):
        return nf4_linear_native(x, q, bias)
    x2 = as_rows(x)
    y = Nf4LinearFunction.apply(x2, q.packed, q.qabs, q.absmax2, q.offset, q.shape).view(*x.shape[:-1], q.shape[0])
    return y if bias is None else y + bias
