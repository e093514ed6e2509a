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

GEMM ``y = x W'^T`` (``x [M, K]``, fp32 accumulation, ``y`` in x's dtype), two paths chosen by rows (``nf4_matmul``):
- up to ``FUSED_MAX_ROWS`` rows (decode), forward, K % 64 == 0: the fused GEMM, which dequantises in its prologue and
  reads only the 0.52 bytes a weight: program (i, j, s) owns a ``[BLOCK_M, BLOCK_N]`` output tile and split s of the
  reduction, a step covering 2 NF4 blocks of each weight row (64 contiguous packed bytes, one scale a block), the
  nibbles indexing the 16-entry code table, the high and low nibbles (W''s even and odd columns) each the A operand of
  ``tl.dot`` against x's matching columns (out^T = W' x^T), splits adding fp32 partials in a fixed order, one
  pipeline stage (see the kernel);
- else (and the input gradient): a one-pass Triton dequantisation writes W' in x's dtype (32 packed bytes and one
  scale a block in, 64 values out, in fp32 then rounded) and cuBLAS (``torch.matmul``) multiplies, bitsandbytes'
  training path.
A variant (``_path="planes"``, bench rows only until measured) reads the packed bytes as int32 words and dequantises
and multiplies one nibble plane of them at a time: 128 registers a thread on sm_90 where the fused GEMM takes ~250
(a byte a register, 64 codes a thread live), so 4 programs an SM instead of 2.
Measured on an H100 (bench/nf4_gemm.py, 261adea): at the 32B shape's gate_up the fused GEMM takes 0.29-0.34 ms at M =
1-8 where the pass takes 0.45, at its down 0.16-0.21 vs 0.23; both 0.43-0.46 / 0.23-0.26 at 16; from 32 rows the pass
wins 2-8x. At M = 1 the fused GEMM reads its 0.52 bytes a weight at ~13% of HBM's rate: there is room left.
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
def _nf4_matmul_kernel(a_ptr, q_ptr, qabs_ptr, abs2_ptr, off_ptr, code_ptr, code2_ptr, out_ptr, M, N, K,
                       stride_am, stride_om, stride_os, STEPS, DOT_PREC: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    # out [M, N] (split s of K: out + s stride_os) = a [M, K] @ W'^T with K % 64 == 0. A step covers BLOCKS NF4
    # blocks of each weight row: 32 BLOCKS packed bytes, contiguous (vector loads), and one scale a block; the high
    # nibbles are W''s even columns, the low ones the odd columns, each multiplied by a's matching columns (strided
    # loads of the small activation). Program (i, j, s) walks STEPS steps from step s STEPS (split-K).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    R: tl.constexpr = BLOCKS * 32
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    offs_b = tl.arange(0, BLOCKS)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offset = tl.load(off_ptr)
    nblk = K // 64
    row_bytes = offs_n.to(tl.int64) * (K // 2)
    row_blk = offs_n.to(tl.int64) * nblk
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # Run with num_stages=1: Triton's pipeliner would stage the code-table lookups (gathers indexed by the loaded
    # bytes) through shared memory as 4-byte async copies, 32 KB a table and stage: one program an SM, and slow. The
    # packed bytes of step t + 1 are loaded instead while step t computes (a register double buffer).
    t0 = pid_s * STEPS
    r_ok = t0 * BLOCKS * 32 + offs_r < K // 2
    nxt = tl.load(q_ptr + row_bytes[:, None] + t0 * BLOCKS * 32 + offs_r[None, :],
                  mask=n_ok[:, None] & r_ok[None, :], other=0)  # fmt: skip
    for t in range(t0, t0 + STEPS):
        b0 = t * BLOCKS  # the step's first NF4 block of each row
        r_ok = b0 * 32 + offs_r < K // 2
        byte = nxt.to(tl.int32)
        r_next = (b0 + BLOCKS) * 32 + offs_r
        nxt = tl.load(q_ptr + row_bytes[:, None] + r_next[None, :],
                      mask=n_ok[:, None] & ((r_next < K // 2) & (t + 1 < t0 + STEPS))[None, :], other=0)  # fmt: skip
        blk = row_blk[:, None] + b0 + offs_b[None, :]
        b_ok = n_ok[:, None] & (b0 + offs_b < nblk)[None, :]
        qa = tl.load(qabs_ptr + blk, mask=b_ok, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + qa) * tl.load(abs2_ptr + blk // BLOCKSIZE2, mask=b_ok, other=0.0) + offset
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCKS, 32)), (BLOCK_N, R))
        col = (b0 * 32 + offs_r) * 2  # the even columns of a that the high nibbles meet
        a_mask = m_ok[:, None] & r_ok[None, :]
        a_even = tl.load(a_rows + col[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_rows + col[None, :] + 1, mask=a_mask, other=0.0)
        hi = (tl.load(code_ptr + (byte >> 4)) * scale).to(a_even.dtype)
        lo = (tl.load(code_ptr + (byte & 0xF)) * scale).to(a_even.dtype)
        # out^T = W' a^T: the dequantised weight tile is the MMA's A operand (from registers: no shared-memory round
        # trip), the small activation its B
        acc = tl.dot(hi, tl.trans(a_even), acc, input_precision=DOT_PREC)
        acc = tl.dot(lo, tl.trans(a_odd), acc, input_precision=DOT_PREC)
    tl.store(out_ptr + pid_s.to(tl.int64) * stride_os + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])  # fmt: skip


@triton.jit
def _nf4_planes_kernel(a_ptr, w_ptr, qabs_ptr, abs2_ptr, off_ptr, code_ptr, code2_ptr, out_ptr, M, N, K,
                       stride_am, stride_om, stride_os, STEPS, DOT_PREC: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    # As _nf4_matmul_kernel, with the packed bytes read as int32 words (4 bytes, 8 NF4 codes: 4x fewer registers
    # than a byte a register) and each word's 8 nibble planes dequantised and multiplied one at a time: nibble p
    # (bits 4p..4p+3) of word w is element 8 w + (p ^ 1) of the row (little-endian bytes, the high nibble first in
    # a byte), so plane p is a [BLOCK_N, 8 BLOCKS] A operand against a's columns 8 w + (p ^ 1). BLOCKS >= 2 (a dot's
    # K is at least 16).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    W: tl.constexpr = BLOCKS * 8  # words a row a step
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, W)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offset = tl.load(off_ptr)
    nblk = K // 64
    nwords = K // 8
    row_words = offs_n.to(tl.int64) * nwords
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t0 = pid_s * STEPS  # one stage, the next step's words loaded while a step computes (see _nf4_matmul_kernel)
    nxt = tl.load(w_ptr + row_words[:, None] + t0 * W + offs_w[None, :],
                  mask=n_ok[:, None] & (t0 * W + offs_w < nwords)[None, :], other=0)  # fmt: skip
    for t in range(t0, t0 + STEPS):
        words = nxt
        w_at = t * W + offs_w  # the step's words of each row
        w_ok = w_at < nwords
        w_next = w_at + W
        nxt = tl.load(w_ptr + row_words[:, None] + w_next[None, :],
                      mask=n_ok[:, None] & ((w_next < nwords) & (t + 1 < t0 + STEPS))[None, :], other=0)  # fmt: skip
        blk = offs_n.to(tl.int64)[:, None] * nblk + (w_at // 8)[None, :]  # each word's NF4 block
        b_ok = n_ok[:, None] & w_ok[None, :]
        qa = tl.load(qabs_ptr + blk, mask=b_ok, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + qa) * tl.load(abs2_ptr + blk // BLOCKSIZE2, mask=b_ok, other=0.0) + offset
        a_mask = m_ok[:, None] & w_ok[None, :]
        for p in tl.static_range(8):
            a_p = tl.load(a_rows + (w_at * 8 + (p ^ 1))[None, :], mask=a_mask, other=0.0)
            w_p = (tl.load(code_ptr + ((words >> (4 * p)) & 0xF)) * scale).to(a_p.dtype)
            acc = tl.dot(w_p, tl.trans(a_p), acc, input_precision=DOT_PREC)
    tl.store(out_ptr + pid_s.to(tl.int64) * stride_os + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])  # fmt: skip


@triton.jit
def _nf4_dequant_kernel(q_ptr, qabs_ptr, abs2_ptr, off_ptr, code_ptr, code2_ptr, out_ptr, n, nblocks,
                        BLOCKSIZE2: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    # W' flat [n] in out's dtype, ROWS NF4 blocks a program: [ROWS, 32] packed bytes (contiguous) and one scale a
    # block in, [ROWS, 64] elements out (high nibble, then low), in fp32 then rounded.
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    b_ok = blk < nblocks
    byte_idx = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    byte = tl.load(q_ptr + byte_idx, mask=b_ok[:, None] & (byte_idx < (n + 1) // 2), other=0).to(tl.int32)
    qa = tl.load(qabs_ptr + blk, mask=b_ok, other=0).to(tl.int32)
    scale = tl.load(code2_ptr + qa) * tl.load(abs2_ptr + blk // BLOCKSIZE2, mask=b_ok, other=0.0) + tl.load(off_ptr)
    hi = tl.load(code_ptr + (byte >> 4)) * scale[:, None]
    lo = tl.load(code_ptr + (byte & 0xF)) * scale[:, None]
    w = tl.reshape(tl.join(hi, lo), (ROWS, 64))
    e = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
    tl.store(out_ptr + e, w.to(out_ptr.dtype.element_ty), mask=e < n)


def dequantize_nf4_triton(q: Nf4Weight, dtype=torch.bfloat16) -> torch.Tensor:
    """``dequantize_nf4`` in one Triton pass (the same fp32 arithmetic): reads 0.52 bytes a weight, writes W'."""
    code, code2 = tables(str(q.packed.device))
    n = q.shape[0] * q.shape[1]
    out = torch.empty(q.shape, dtype=dtype, device=q.packed.device)
    rows = 4 if interpreting() else 32
    nblocks = q.qabs.numel()
    if n:
        _nf4_dequant_kernel[(triton.cdiv(nblocks, rows),)](q.packed, q.qabs, q.absmax2, q.offset, code, code2, out,
                                                           n, nblocks, BLOCKSIZE2=BLOCKSIZE2, ROWS=rows)  # fmt: skip
    return out


def fused_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCKS, split, num_warps, num_stages) of the fused GEMM: small tiles in the
    interpreter (speed); else 16 / 32 / 64 rows by M, 64 weight rows and 2 NF4 blocks (128 columns) a step, and K
    split until about four programs an SM run (decode's tiles alone leave most SMs idle: 80 at N = 5120), each split
    writing fp32 partials that one sum adds in a fixed order (no atomics: the same rows give the same bits)."""
    if interpreting():
        return 16, 16, 1, (2 if k >= 128 else 1), 1, 1
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn, blocks = 64, 2  # 4 blocks a step spill registers (ptxas for sm_90: 255 and a stack of 192 B to 2 KB)
    steps = triton.cdiv(k // BLOCKSIZE, blocks)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = max(1, min(steps, 16, (4 * _sms()) // tiles))
    return bm, bn, blocks, split, (4 if bm == 16 else 8), 1  # one stage: see _nf4_matmul_kernel


@functools.cache
def _sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


FUSED_MAX_ROWS = 8  # "auto" takes the fused GEMM up to this many rows (forward, whole blocks); the pass above


def nf4_matmul(a: torch.Tensor, q: Nf4Weight, trans: bool = False, _path: str = "auto", _cfg=None) -> torch.Tensor:
    """``a [M, K] @ W'^T -> [M, N]``, or with ``trans`` ``a [M, N] @ W' -> [M, K]``, fp32 accumulation.
    ``_path``: "fused" the GEMM that dequantises in its prologue (forward, K % 64 == 0; ``_cfg`` its ``fused_config``
    tuple), "planes" the same GEMM reading int32 words a nibble plane at a time (2 or more blocks a step), "dequant"
    W' dequantised in a's dtype by the Triton pass then ``torch.matmul``, "auto" (the default) the fused GEMM up to
    ``FUSED_MAX_ROWS`` rows where it applies, the pass elsewhere (bench/nf4_gemm.py compares them)."""
    n, k = q.shape
    p, r = (k, n) if trans else (n, k)
    assert a.dim() == 2 and a.shape[1] == r and a.stride(1) == 1, f"nf4: a [M, {r}] expected, got {tuple(a.shape)}"
    m = a.shape[0]
    if _path not in ("auto", "fused", "planes", "dequant"):
        raise ValueError(f"nf4_matmul: _path must be auto, fused, planes or dequant, got {_path!r}")
    fused_ok = not trans and k % BLOCKSIZE == 0
    if _path in ("fused", "planes") and not fused_ok:
        raise ValueError(f"nf4_matmul: the fused GEMM is forward only, over whole NF4 blocks (K % {BLOCKSIZE} == 0): "
                         f"trans={trans}, weight {tuple(q.shape)}")
    if _path == "auto":
        _path = "fused" if fused_ok and m <= FUSED_MAX_ROWS else "dequant"
    if _path == "dequant":
        w = dequantize_nf4_triton(q, a.dtype)
        return a @ w if trans else a @ w.t()
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=a.dtype, device=a.device)
    code, code2 = tables(str(a.device))
    bm, bn, blocks, split, warps, stages = _cfg or fused_config(m, n, k)
    if _path == "planes" and blocks < 2:  # a dot's K is at least 16: 8 words a block, 2 blocks
        if _cfg is not None:
            raise ValueError(f"nf4_matmul: the planes GEMM takes 2 or more NF4 blocks a step, got {blocks}")
        blocks = 2
    steps = triton.cdiv(triton.cdiv(k // BLOCKSIZE, blocks), split)
    split = triton.cdiv(triton.cdiv(k // BLOCKSIZE, blocks), steps)  # no split left without a step
    out = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else a.dtype, device=a.device)
    kernel, packed = _nf4_matmul_kernel, q.packed
    if _path == "planes":  # the packed bytes as int32 words (K % 64 == 0: whole words a row)
        kernel, packed = _nf4_planes_kernel, q.packed.view(torch.int32)
    kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        a, packed, q.qabs, q.absmax2, q.offset, code, code2, out, m, n, k, a.stride(0), out.stride(1),
        out.stride(0), steps, DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32", BLOCKSIZE2=BLOCKSIZE2,
        BLOCK_M=bm, BLOCK_N=bn, BLOCKS=blocks, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(0).to(a.dtype)


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
