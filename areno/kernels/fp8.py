"""FP8 block-quantised GEMM (DeepSeek-V3 / vLLM's w8a8 block layout): weight and activation quantisation to E4M3,
dequantisation, a native reference GEMM and a Triton GEMM on pre-quantised fp8 operands; inference only.

Format (what DeepSeek-V3's and Qwen3-FP8's Hub checkpoints hold, ``weight_block_size = [128, 128]``):

    weight W [N, K] (out, in):  one fp32 scale per 128 x 128 block, the last row/column block partial (not padded)
        s_w[i, j] = max(amax(W[128 i : 128 i + 128, 128 j : 128 j + 128]), EPS) / 448       (``weight_scale_inv``,
        Wq[n, k]  = rne_e4m3(W[n, k] / s_w[n / 128, k / 128])                                [ceil(N/128), ceil(K/128)])
    activation x [M, K]: one fp32 scale per token per 128 columns (DeepSeek-V3's ``act_quant``, vLLM's
        ``per_token_group_quant_fp8``):  s_x[m, g] = max(amax(x[m, 128 g : 128 g + 128]), EPS) / 448, xq = x / s_x
    dequantised: W'[n, k] = Wq[n, k] s_w[n / 128, k / 128], x' likewise; 448 is E4M3's largest finite value, so a
    block's amax maps to +-448 exactly and no value saturates; zeros stay exact zeros (EPS keeps an all-zero block's
    scale finite). Round-trip error per element: <= 2^-4 |w| (3 mantissa bits, round to nearest even) above E4M3's
    smallest normal (2^-6 s), <= 2^-10 s below it.

GEMM ``y = x' W'^T`` (x [M, K] bf16/fp16/fp32 -> y [M, N] in x's dtype): the activation is quantised first by its own
kernel (one memory-bound pass over x, M K), then the GEMM reads fp8 x fp8. This is the split DeepSeek-V3
(``act_quant`` + ``fp8_gemm``) and vLLM (``per_token_group_quant_fp8`` + ``w8a8_block_fp8_matmul``) use: the main loop
is an fp8 x fp8 tensor-core dot (sm_90 wgmma at twice bf16's rate) instead of re-quantising the same x tile once per
output column tile (N / BLOCK_N times), and the quantised x can be shared by every projection that reads it.
Program (t, s) owns a [BLOCK_M, BLOCK_N] tile t of y and slice s of K (split-K for decode's small M, as
kernels/gemm.py: fp32 partials summed in split order by ``gemm.splitk_reduce``), walked in BLOCK_K steps (BLOCK_K
divides 128, so a step lies in one scale group): ``acc += dot(xq, Wq^T) * s_x[:, g] s_w[n / 128, g]`` in fp32. The
partial dot covers at most 128 K, then is promoted to the fp32 accumulator with its scales: DeepSeek-V3's fix for
Hopper's limited fp8 accumulator precision. Bytes read: N K (weight) + N K / 16384 * 4 (scales) + M K (xq), half of
bf16's weight read.

Where cuBLAS has the same recipe (sm_90, CUDA >= 12.9: ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` x
``BlockWise128x128`` scales), ``fp8_linear`` multiplies there instead (:func:`fp8_linear_cublas`): the same kernel
quantises x (rows padded to a multiple of 4, scales written outer-dim-major, as cuBLAS asks), the weight is the same
Fp8Weight. bench/fp8_gemm.py on an H100: cuBLAS's GEMM matches the Triton GEMM's error against the native reference
on every shape, is as fast as its best tiles at decode sizes and 1.5-1.9x faster from M = 256 up (1.6x bf16's
cuBLAS GEMM in prefill).

The E4M3 rounding is done in fp32 before the cast (:func:`round_e4m3`), so the value cast is exact: the Triton
interpreter's fp32 -> fp8 conversion rounds ties away and drops the carry into the exponent (1.9375001 -> 1.0), and
the same code then runs bit for bit on the CPU and the GPU (where the cast is ``cvt.rn.satfinite``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from areno.kernels._device import sm_count
from areno.kernels.dispatch import as_rows, interpreting, use_triton
from areno.kernels.gemm import GemmConfig, heuristic_config, splitk_reduce, store_gemm_tile

BLOCK = 128  # weight block edge and activation group width
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
EPS = 1e-10  # floor of a block's amax (vLLM's per_token_group_quant_fp8 default): an all-zero block stays finite
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
EXPERT_CHUNK = 8  # experts quantised together (a 30B-A3B layer's w13 in fp32: 1.6 GB; 8 experts: 100 MB)


class Fp8Weight(NamedTuple):
    """A quantised ``[N, K]`` weight: ``qweight`` float8_e4m3fn ``[N, K]``, ``scale`` fp32 ``[ceil(N/128),
    ceil(K/128)]`` (the checkpoints' ``weight_scale_inv``: dequantised = qweight * scale); or a stack of routed
    experts' weights, ``[E, N, K]`` with scales ``[E, ceil(N/128), ceil(K/128)]`` (kernels/moe/fp8.py)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple:
        return tuple(self.qweight.shape)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4


def _check_float(t: torch.Tensor, what: str, dims: int | None = None) -> None:
    if not t.is_floating_point() or t.dtype == FP8 or (dims is not None and t.dim() != dims):
        raise ValueError(f"fp8: {what} must be a{' 2-D' if dims else ''} float tensor, got {t.dtype} {tuple(t.shape)}")


def block_scales_of(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales (``amax / 448``, amax floored at EPS) of fp32 block absmaxes, correctly rounded on every device:
    torch's CUDA division by a Python scalar multiplies by its rounded reciprocal (one ulp off ``amax / 448`` for
    some amax, which the Triton quantiser's ``div_rn`` is not), so the divisor is a tensor on amax's device."""
    return amax.clamp(min=EPS) / torch.full_like(amax, FP8_MAX)


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)  # round to nearest even; |scaled| <= 448 up to fp32 rounding


def quantize_weight_fp8(w: torch.Tensor) -> Fp8Weight:
    """``w [N, K]`` (any float dtype) as E4M3 with one fp32 scale per 128 x 128 block (native PyTorch: run once per
    weight update, on any device); ``w [E, N, K]`` (stacked experts) block by block within each expert, a few
    experts at a time (the fp32 temporaries stay small)."""
    if w.dim() != 3:
        _check_float(w, "the weight", dims=2)
    _check_float(w, "the weight")
    if w.dim() == 3 and w.shape[0] > EXPERT_CHUNK:
        parts = [quantize_weight_fp8(w[i : i + EXPERT_CHUNK]) for i in range(0, w.shape[0], EXPERT_CHUNK)]
        return Fp8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]))
    *lead, n, k = w.shape
    pn, pk = (-n) % BLOCK, (-k) % BLOCK
    tiles = F.pad(w.detach().float(), (0, pk, 0, pn)).view(*lead, (n + pn) // BLOCK, BLOCK, (k + pk) // BLOCK, BLOCK)
    scale = block_scales_of(tiles.abs().amax(dim=(-3, -1)))
    q = _to_fp8(tiles / scale[..., :, None, :, None]).view(*lead, n + pn, k + pk)[..., :n, :k].contiguous()
    return Fp8Weight(q, scale)


def dequantize_weight_fp8(q: Fp8Weight, dtype=torch.float32) -> torch.Tensor:
    """``[N, K]`` (or ``[E, N, K]``) in ``dtype`` (the product computed in fp32)."""
    n, k = q.shape[-2:]
    s = q.scale.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]
    return (q.qweight.float() * s).to(dtype)


def quantize_act_fp8_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``xq`` fp8 ``[M, K]``, ``s`` fp32 ``[M, ceil(K/128)]``): per token, per 128 columns."""
    m, k = x.shape
    pk = (-k) % BLOCK
    groups = F.pad(x.float(), (0, pk)).view(m, (k + pk) // BLOCK, BLOCK)
    s = block_scales_of(groups.abs().amax(dim=2))
    return _to_fp8(groups / s[:, :, None]).view(m, k + pk)[:, :k].contiguous(), s


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (fp8 ``[..., D]``, fp32 scales ``[...]``): one scale per row (the FP8 KV cache's per token
    and head: ``s = max(amax, EPS) / 448``)."""
    s = block_scales_of(x.float().abs().amax(dim=-1))
    return _to_fp8(x.float() / s[..., None]), s


def dequantize_act_fp8(xq: torch.Tensor, s: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``xq [M, K]`` with per-group scales ``s [M, ceil(K/128)]`` as ``[M, K]`` in ``dtype``."""
    return (xq.float() * s.repeat_interleave(BLOCK, 1)[:, : xq.shape[1]]).to(dtype)


def fp8_matmul_native(xq: torch.Tensor, xs: torch.Tensor, q: Fp8Weight, out_dtype=torch.float32) -> torch.Tensor:
    """The reference GEMM: dequantise both operands to fp32, ``x' @ W'^T`` in fp32, then ``out_dtype``."""
    return (dequantize_act_fp8(xq, xs) @ dequantize_weight_fp8(q).T).to(out_dtype)


# ---------------------------------------------------------------------------------------------- Triton kernels


@triton.jit
def round_e4m3(v):
    # v (fp32, |v| <= 448) rounded to the nearest E4M3 value (ties to even), still fp32: adding then subtracting
    # 1.5 * 2^23 ulp rounds |v| to a multiple of ulp in fp32's round-to-nearest-even, where ulp = 2^(e - 3) is E4M3's
    # spacing at |v|'s binade e (2^-9 below the smallest normal 2^-6).
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((e + 124 + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^23 * 2^(e - 3)
    r = (a + magic) - magic
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # v's sign, -0 too


@triton.jit
def quant_groups(y, EPS: tl.constexpr, FP8_MAX: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    # y fp32 [ROWS, COLS], COLS a multiple of 128 -> (E4M3 values as fp32 [ROWS, COLS], scales [ROWS, COLS / 128]),
    # _act_quant_kernel's arithmetic per 128-column group: for producers that quantise their own output (the FP8
    # rollout's norm and SwiGLU: kernels/norm.py, kernels/activation.py).
    g = tl.reshape(y, (ROWS, COLS // 128, 128))
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(g), axis=2), EPS), FP8_MAX)
    v = tl.minimum(tl.maximum(tl.div_rn(g, s[:, :, None]), -FP8_MAX), FP8_MAX)
    return tl.reshape(round_e4m3(v), (ROWS, COLS)), s


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_sm, stride_sg, EPS: tl.constexpr,
                      FP8_MAX: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    # Program (i, g): rows [i ROWS, i ROWS + ROWS), columns of group g: s = max(amax, EPS) / 448, q = rne(x / s);
    # rows M .. M_OUT (cuBLAS's padding to a multiple of 4) are written as zeros (scale EPS / 448).
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    offs_k = g * GROUP + tl.arange(0, GROUP)
    k_ok = (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :], mask=(offs_m < M)[:, None] & k_ok,
                other=0.0)
    x = x.to(tl.float32)
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), EPS), FP8_MAX)
    v = tl.minimum(tl.maximum(tl.div_rn(x, s[:, None]), -FP8_MAX), FP8_MAX)
    out_ok = offs_m < M_OUT
    tl.store(q_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], round_e4m3(v).to(q_ptr.dtype.element_ty),
             mask=out_ok[:, None] & k_ok)
    tl.store(s_ptr + offs_m.to(tl.int64) * stride_sm + g * stride_sg, s, mask=out_ok)


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, ws_ptr, M, N, K, G, k_split,
                     HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr, GROUP: tl.constexpr,
                     GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):  # fmt: skip
    # c [M, N] = (a [M, K] * as [M, G]) @ (b [N, K] * bs [cdiv(N, GROUP), G])^T; a, b fp8 contiguous. Program
    # (t, s): output tile t over K in [s k_split, (s + 1) k_split) (k_split % BLOCK_K == 0); DIRECT (one split): c
    # written here, else the fp32 partial to ws [SPLIT_K, M, N] (gemm.splitk_reduce sums it). Tiles are ordered
    # GROUP_M row tiles at a time (tl.swizzle2d), so consecutive programs share weight tiles in L2.
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_m, pid_n = tl.swizzle2d(pid // tiles_n, pid % tiles_n, tl.cdiv(M, BLOCK_M), tiles_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)  # past the edge: reread valid rows/cols (the store masks)
    cols = (offs_n % N).to(tl.int64)
    k0 = tl.program_id(1) * k_split
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * K + (k0 + ks)[None, :]
    b_ptrs = b_ptr + cols[None, :] * K + (k0 + ks)[:, None]  # [BLOCK_K, BLOCK_N] view of b^T (K contiguous)
    as_ptrs = as_ptr + rows * G
    bs_ptrs = bs_ptr + (cols // GROUP) * G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k0, tl.minimum(k0 + k_split, K), BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = ks < K - kk
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        g = kk // GROUP
        sa = tl.load(as_ptrs + g)
        sb = tl.load(bs_ptrs + g)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    store_gemm_tile(acc, c_ptr, ws_ptr, bias_ptr, offs_m, offs_n, cols, M, N, tl.program_id(1), HAS_BIAS, DIRECT)


# ---------------------------------------------------------------------------------------------- launchers


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: ``x [M, K]`` (unit last stride) -> (``xq`` fp8 ``[M, K]``, ``s`` fp32 ``[M, ceil(K/128)]``), the
    same bytes as :func:`quantize_act_fp8_native`."""
    return _quantize_act(x, x.shape[0], scales_by_column=False)


def quantize_act_fp8_cublas(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act_fp8`` in cuBLAS's layout: ``xq`` [M4, K] and ``s`` [M4, G] for M4 = M rounded up to a multiple
    of 4 (rows past M zero, their scales EPS / 448), ``s`` a view of a ``[G, M4]`` tensor (outer-dim-major)."""
    return _quantize_act(x, cublas_rows(x.shape[0]), scales_by_column=True)


def cublas_rows(m: int) -> int:
    """The rows of cuBLAS's activation layout for M rows: M rounded up to a multiple of 4 (at least 4)."""
    return -(-max(m, 1) // 4) * 4


def cublas_act_buffers(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (``xq`` ``[M4, K]`` fp8, ``s`` ``[M4, G]`` fp32 as a view of ``[G, M4]``): cuBLAS's activation layout
    (:func:`quantize_act_fp8_cublas`), for kernels that quantise their own output into it."""
    rows = cublas_rows(m)
    g = triton.cdiv(k, BLOCK)
    return (torch.empty(rows, k, dtype=FP8, device=device),
            torch.empty(g, rows, dtype=torch.float32, device=device).t())  # fmt: skip


def quantize_act_fp8_cublas_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of :func:`quantize_act_fp8_cublas` (and of the producers that fill :func:`cublas_act_buffers`):
    ``quantize_act_fp8_native`` on x with zero rows appended up to a multiple of 4, scales outer-dim-major."""
    m, k = x.shape
    bq, bs = cublas_act_buffers(m, k, x.device)
    xq, s = quantize_act_fp8_native(F.pad(x, (0, 0, 0, bq.shape[0] - m)))
    bq.copy_(xq)
    bs.copy_(s)
    return bq, bs


def fused_act_applies(y: torch.Tensor, k: int | None = None) -> bool:
    """Whether a producer (the FP8 rollout's norm, SwiGLU) should quantise its output ``y`` for the FP8 GEMMs that
    read it: inference, bf16 on a GPU with cuBLAS's block-scaled GEMM (the layout is cuBLAS's), whole 128-column
    groups (``k``: the width, default y's last dim)."""
    k = y.shape[-1] if k is None else k
    return (not torch.is_grad_enabled() and y.dtype == torch.bfloat16 and k % BLOCK == 0 and y.is_cuda
            and cublas_fp8_ready(y.device))


def _quantize_act(x: torch.Tensor, rows: int, scales_by_column: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act_fp8`` into ``rows`` >= M rows (the extra ones zero), the scales row-major ``[rows, G]`` or,
    ``scales_by_column``, a ``[rows, G]`` view of a ``[G, rows]`` tensor."""
    assert x.dim() == 2 and x.stride(1) == 1, f"fp8: x [M, K] with unit last stride expected, got {tuple(x.shape)}"
    m, k = x.shape
    g = triton.cdiv(k, BLOCK)
    xq = torch.empty(rows, k, dtype=FP8, device=x.device)
    s = torch.empty(g, rows, dtype=torch.float32, device=x.device).t() if scales_by_column else \
        torch.empty(rows, g, dtype=torch.float32, device=x.device)  # fmt: skip
    if rows and k:
        r = 4 if interpreting() else 8
        _act_quant_kernel[(triton.cdiv(rows, r), g)](x, xq, s, m, rows, k, x.stride(0), s.stride(0), s.stride(1),
                                                    EPS=EPS, FP8_MAX=FP8_MAX, ROWS=r, GROUP=BLOCK,
                                                    num_warps=4)  # fmt: skip
    return xq, s


@functools.lru_cache(maxsize=16)
def cublas_fp8_ready(device: torch.device) -> bool:
    """Whether cuBLAS's block-scaled fp8 GEMM (DeepSeek's recipe: 1 x 128 activation and 128 x 128 weight scales,
    ``torch.nn.functional.scaled_mm``) runs here: torch implements it for sm_90 (H100 / H200) on CUDA >= 12.9."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return (torch.cuda.get_device_capability(device) == (9, 0) and cuda >= (12, 9)
            and hasattr(F.ScalingType, "BlockWise1x128") and hasattr(F.ScalingType, "BlockWise128x128"))


def cublas_fp8_applies(x: torch.Tensor, q: Fp8Weight) -> bool:
    """cuBLAS's path: bf16 x (the output dtype bench/fp8_gemm.py measured) on a GPU that has it, for whole 128-blocks
    (N and K multiples of 128)."""
    n, k = q.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and n % BLOCK == 0 and k % BLOCK == 0 and q.qweight.dim() == 2
            and cublas_fp8_ready(x.device))


def act_alone_applies(x: torch.Tensor, q: Fp8Weight) -> bool:
    """Whether :func:`fp8_linear` of x given ``act`` (its producer's quantisation, :func:`cublas_act_buffers`' shape
    for x's rows) multiplies that alone and never reads x's values: the Triton path with cuBLAS's GEMM."""
    return use_triton(x, q.qweight, supported=x.dtype in _FLOATS) and cublas_fp8_applies(x, q)


def fp8_matmul_cublas(xq: torch.Tensor, xs: torch.Tensor, q: Fp8Weight, out_dtype=torch.bfloat16,
                      rows: int | None = None) -> torch.Tensor:  # fmt: skip
    """cuBLAS's ``x' W'^T`` on :func:`quantize_act_fp8_cublas`'s operands, the weight scales padded to a multiple of
    4 K-groups and transposed (the layouts cuBLAS asks for); the first ``rows`` rows of the product (a view: the
    output stays contiguous), all by default."""
    g = xs.shape[1]
    sw = q.scale.contiguous() if g % 4 == 0 else F.pad(q.scale, (0, 4 - g % 4))  # [N / 128, G4]; .t() is [G4, N / 128]
    st = F.ScalingType
    y = F.scaled_mm(xq, q.qweight.t(), xs, st.BlockWise1x128, sw.t(), st.BlockWise128x128, output_dtype=out_dtype)
    return y if rows is None else y[:rows]


def fp8_linear_cublas(x2: torch.Tensor, q: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x2 [M, K] @ W'^T (+ bias)`` through cuBLAS (:func:`quantize_act_fp8_cublas`, then
    :func:`fp8_matmul_cublas`). bench/fp8_gemm.py on an H100: as fast as the best Triton tiles at decode sizes,
    1.5-1.9x faster from M = 256 up."""
    y = fp8_matmul_cublas(*quantize_act_fp8_cublas(x2), q, x2.dtype, rows=x2.shape[0])
    return y if bias is None else y + bias


def fp8_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """The tile config: small tiles in the interpreter (speed); on a GPU 64 x 128 tiles, 3 stages past M = 256 (the
    sweep's best at M = 1024 and 8192 on every bench/fp8_gemm.py shape), else the small-M GEMM's heuristic (16-row
    tiles to M = 16, columns widened while tiles outnumber SMs, K split to about one program per SM) with 128-wide K
    steps (one scale group; an fp8 step of 128 is a bf16 step of 64 in bytes)."""
    if interpreting():
        return GemmConfig(16, 32, 64, 1, 1, 1)
    if m > 256:  # prefill: the H100 sweep's best from M = 1024 up, ~4x the heuristic's 128 x 128 tiles on 4 warps
        return GemmConfig(64, 128, BLOCK, 1, 4, 3)
    return heuristic_config(m, n, k, sm_count(device.index or 0))._replace(block_k=BLOCK)


def fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, q: Fp8Weight, out_dtype=torch.bfloat16,
               bias: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:  # fmt: skip
    """Triton: ``x' [M, K] @ W'^T (+ bias) -> [M, N]`` in ``out_dtype`` from fp8 ``xq`` with per-group scales
    ``xs``, fp32 accumulation; ``config`` pins the tiles (tests, benchmarks; BLOCK_K must divide 128)."""
    n, k = q.shape
    m = xq.shape[0]
    assert xq.shape == (m, k) and xq.dtype == FP8 and xq.is_contiguous(), f"fp8: xq [M, {k}] fp8 expected"
    assert xs.shape == (m, triton.cdiv(k, BLOCK)) and xs.is_contiguous(), "fp8: xs [M, ceil(K/128)] expected"
    assert q.qweight.is_contiguous() and q.scale.shape == (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    bm, bn, bk, split, warps, stages = config or fp8_config(m, n, k, xq.device)
    assert BLOCK % bk == 0 and split >= 1, f"fp8: BLOCK_K must divide {BLOCK}: {config}"
    k_split = triton.cdiv(triton.cdiv(k, bk), split) * bk  # whole BLOCK_K steps per split
    split = triton.cdiv(k, k_split)  # no empty splits
    direct = split == 1
    ws = out if direct else torch.empty(split, m, n, dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    scale = q.scale.contiguous()
    _fp8_gemm_kernel[grid](xq, xs, q.qweight, scale, bias if bias is not None else out, out, ws, m, n, k,
                           scale.shape[1], k_split, HAS_BIAS=bias is not None, DIRECT=direct, EVEN_K=k % bk == 0,
                           GROUP=BLOCK, GROUP_M=8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                           num_stages=stages)  # fmt: skip
    return out if direct else splitk_reduce(ws, out, bias)


def fp8_linear_native(x: torch.Tensor, q: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: quantise x per token and group, dequantise both operands, matmul in fp32, x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    y = fp8_matmul_native(*quantize_act_fp8_native(x2), q)
    y = y if bias is None else y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], q.shape[0])


def fp8_linear(x: torch.Tensor, q: Fp8Weight, bias: torch.Tensor | None = None, *, act=None,
               _gemm: str = "auto") -> torch.Tensor:  # fmt: skip
    """``x [..., K] @ W'^T (+ bias) -> [..., N]`` in x's dtype, x quantised per token and 128 columns: on the Triton
    path the activation kernel, then cuBLAS's block-scaled GEMM where it applies (:func:`cublas_fp8_applies`; bf16 x)
    or areno's Triton GEMM (``_gemm="triton"`` pins it: benchmarks, tests); else the native reference. ``act``: x
    already quantised in cuBLAS's layout by the kernel that produced it (``(xq, s)`` of :func:`cublas_act_buffers`,
    the same bytes as :func:`quantize_act_fp8_cublas` of x): the cuBLAS path multiplies it and skips the activation
    kernel; the other paths ignore it. Inference only (rollout): there is no gradient through the rounding."""
    _check_float(x, "x")
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"fp8_linear: x's last dim is {x.shape[-1]}, the weight is {tuple(q.shape)}")
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        raise ValueError("fp8_linear is inference-only (no gradient through fp8 rounding): call it under no_grad")
    if not use_triton(x, q.qweight, supported=x.dtype in _FLOATS):
        return fp8_linear_native(x, q, bias)
    x2 = as_rows(x)
    b = None if bias is None else bias.contiguous()
    if _gemm not in ("auto", "triton", "cublas"):
        raise ValueError(f"fp8_linear: _gemm is 'auto', 'triton' or 'cublas', got {_gemm!r}")
    cublas = cublas_fp8_applies(x2, q)
    if _gemm == "cublas" and not cublas:
        raise RuntimeError(f"fp8_linear(_gemm='cublas'): cuBLAS's block-scaled GEMM does not apply here ({x.device}, "
                           f"{x.dtype}, weight {tuple(q.shape)}: sm_90, CUDA >= 12.9, bf16 x, N and K % 128)")
    if cublas and _gemm != "triton":
        rows = cublas_rows(x2.shape[0])
        if act is not None and act[0].shape == (rows, x2.shape[1]) and act[1].shape == (rows, q.scale.shape[1]):
            y = fp8_matmul_cublas(act[0], act[1], q, x2.dtype, rows=x2.shape[0])
            y = y if b is None else y + b
        else:
            y = fp8_linear_cublas(x2, q, b)
    else:
        y = fp8_matmul(*quantize_act_fp8(x2), q, out_dtype=x.dtype, bias=b)
    return y.view(*x.shape[:-1], q.shape[0])
