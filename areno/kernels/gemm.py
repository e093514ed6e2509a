"""Small-M GEMM ``y = x @ W^T`` (the nn.Linear layout) for decode batches, with split-K: inference only.

    x [M, K] (rows at any stride, unit last stride), W [N, K] (likewise), y [M, N] in x's dtype, fp32 accumulation
    y[m, n] = sum_k x[m, k] W[n, k]  (+ bias[n])

Why: in rollout decode M is the batch (one token per sequence, M ~ 1..512) while N and K are the model's widths,
so a tile shape made for large M leaves most SMs idle (a 256 x 1024 output in 128 x 128 tiles is 16 CTAs on 132
SMs). Here each program owns a [BLOCK_M, BLOCK_N] tile of y and 1/SPLIT_K of the K range, so cdiv(M, BLOCK_M)
cdiv(N, BLOCK_N) SPLIT_K programs (aim: about one per SM) share the weight read. Programs are ordered M-tile fastest,
so the ones that read the same weight tile run together and all but the first find it in L2.

Split-K is deterministic and graph-capturable (no host sync, shapes fixed by the inputs):
    program (i, j, s) writes its fp32 partial of y[tile] over K-slice s to ws[s, M, N]  (SPLIT_K M N 4 bytes), then
    _splitk_reduce_kernel sums ws over s in split order, adds the bias, rounds to y's dtype. (Reducing in the GEMM's
    last program per tile instead, through atomic tile counters, saved the second launch but measured the same.)
SPLIT_K = 1 writes y (bias included) from the GEMM's epilogue: one launch.

Cost: 2 M N K FLOPs; bytes >= 2 (N K + M K + M N) for 16-bit inputs, plus 8 SPLIT_K M N (workspace, mostly in L2).
At M = 256 the weight read and the MMA time are about equal on an H200 (intensity M FLOP/byte vs ~170 at 700
TFLOP/s / 4.2 TB/s); below that the kernel should approach the weight-read time N K 2 / 4.2 TB/s.

Configs: :class:`GemmConfig` = (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages).
:func:`default_config` looks shapes up in ``TUNED`` (from ``bench/gemm.py``'s sweep on an H200); shapes not there,
and entries that say None (cuBLAS was as fast), go to cuBLAS. :func:`linear` uses the kernel only for
M <= ``TRITON_MAX_M`` (128: the sweep found cuBLAS as fast from 256), without autograd (there is no backward here: a
call that needs gradients goes to ``F.linear``), where the picker has a config, and through ``use_triton``.

Measured (bench/gemm.py, H200, bf16, Qwen3-0.6B decode shapes, per call in a CUDA graph, weights from HBM): a
kernel that only reads W takes 3-5 us there (launch and ramp-up dominate: 4 MB should take 1 us), cuBLAS 5.3-8 us at
M <= 256 (12.6 us for o_proj at M = 1). The best Triton config wins by 2-23% for the N = 1024 projections (o_proj,
down_proj) at most M <= 256 (2.3x for o_proj at M = 1) and qkv_proj at M = 64, and loses by 5-15% at the wide N
(gate_up_proj always, qkv_proj at M >= 128) and everywhere at M = 512: ``TUNED`` keeps cuBLAS there.
Both Triton and cuBLAS stay 1.3-2.5x above the read-only time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from areno.kernels._device import sm_count
from areno.kernels.dispatch import use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_M = 128  # linear() runs the Triton kernel for 1 <= M <= this (0 = never); set from bench/gemm.py's sweep
_REDUCE_BLOCK = 1024


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


# ---------------------------------------------------------------------------------------------- Triton kernels


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, stride_wn, k_split,
                 HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # Program (pid_m, pid_n, pid_k): y[tile] over K in [pid_k k_split, (pid_k + 1) k_split), k_split % BLOCK_K == 0.
    # DIRECT (split_k == 1): y [M, N] written here. Else the fp32 partial goes to ws [split_k, M, N].
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows/cols past the edge reread valid ones, so the loads need no M/N mask (the stores mask).
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    k0 = pid_k * k_split
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k0 + ks)[:, None]  # [BLOCK_K, BLOCK_N] view of W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if EVEN_K:  # K == split_k k_split: every tile is whole
        for _ in range(0, k_split // BLOCK_K):
            acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc, input_precision=DOT_PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:  # the last split(s) may be short or empty (then they write zero partials)
        k_left = tl.minimum(k_split, K - k0)
        for kb in range(0, tl.cdiv(k_left, BLOCK_K)):
            k_ok = ks < k_left - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    store_gemm_tile(acc, y_ptr, ws_ptr, b_ptr, offs_m, offs_n, cols, M, N, pid_k, HAS_BIAS, DIRECT)


@triton.jit
def store_gemm_tile(acc, y_ptr, ws_ptr, b_ptr, offs_m, offs_n, cols, M, N, pid_k, HAS_BIAS: tl.constexpr,
                    DIRECT: tl.constexpr):  # fmt: skip
    # The split-K GEMMs' epilogue (this file's and kernels/fp8.py's): DIRECT writes the fp32 tile acc (+ bias[cols])
    # to y [M, N] in y's dtype, else the partial to ws[pid_k] (ws [SPLIT_K, M, N] fp32, summed by splitk_reduce).
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + out_offs, acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, y_ptr, MN, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                          BLOCK: tl.constexpr):  # fmt: skip
    # y = sum_s ws[s] (+ bias), summed in split order: the result does not depend on program timing.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------- launcher


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def gemm_launch(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, bias: torch.Tensor | None = None):
    """``x @ weight.T (+ bias)`` as [M, N] in x's dtype with an explicit config (no dispatch, no autograd)."""
    assert x.dim() == 2 and weight.dim() == 2, (
        f"gemm: x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K, f"gemm: x has K={K} but weight is {tuple(weight.shape)} (want [N, {K}])"
    assert x.dtype in _FLOATS and weight.dtype == x.dtype, (
        f"gemm: x and weight must share fp16/bf16/fp32, got {x.dtype}, {weight.dtype}")
    assert x.stride(1) == 1 and weight.stride(1) == 1, "gemm: x and weight need unit stride along K"
    assert bias is None or (bias.shape == (N,) and bias.is_contiguous()), f"gemm: bias must be contiguous [N={N}]"
    bm, bn, bk, split, warps, stages = config
    assert all(_pow2(b) and b >= 16 for b in (bm, bn, bk)), f"gemm: BLOCK_M/N/K must be powers of 2 >= 16: {config}"
    assert split >= 1, f"gemm: SPLIT_K must be >= 1, got {split}"
    assert M * N < 2**31, f"gemm: M N = {M * N} must be < 2^31"
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))
    k_split = triton.cdiv(triton.cdiv(K, bk), split) * bk  # whole BLOCK_K tiles per split
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    direct = split == 1
    ws = y if direct else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else y
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    _gemm_kernel[grid](x, weight, b, y, ws, M, N, K, x.stride(0), weight.stride(0), k_split,
                       HAS_BIAS=bias is not None, DIRECT=direct, EVEN_K=K == split * k_split,
                       DOT_PREC=prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                       num_warps=warps, num_stages=stages)  # fmt: skip
    if not direct:
        splitk_reduce(ws, y, bias)
    return y


def splitk_reduce(ws: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y [M, N] = sum_s ws[s] (+ bias)`` over the fp32 split-K partials ``ws [SPLIT_K, M, N]``, summed in split
    order (deterministic), rounded to y's dtype; y and bias contiguous. Also the FP8 GEMM's (kernels/fp8.py)."""
    split, M, N = ws.shape
    _splitk_reduce_kernel[(triton.cdiv(M * N, _REDUCE_BLOCK),)](
        ws, bias if bias is not None else y, y, M * N, N, HAS_BIAS=bias is not None, SPLIT_K=split,
        BLOCK=_REDUCE_BLOCK, num_warps=4)
    return y


# ---------------------------------------------------------------------------------------------- default config

# (N, K) -> [(M, config or None), ...] sorted by M. A call of size M takes the entry of the smallest tuned M' >= M
# (the last entry past the end), its BLOCK_M capped at next_pow2(M); None: F.linear (cuBLAS) was as fast or faster.
# Measured by bench/gemm.py (its suggested table) on an H200, bf16, torch 2.11 / triton 3.6, 2026-11-30: a config is
# kept where the best Triton time was >= 2% under cuBLAS's, in a CUDA graph with the weights read from HBM.
TUNED: dict[tuple[int, int], list[tuple[int, GemmConfig | None]]] = {
    (1024, 2048): [(1, GemmConfig(16, 32, 128, 4, 4, 4)), (16, GemmConfig(16, 32, 128, 4, 4, 4)), (64, None),
                   (128, None), (256, GemmConfig(64, 32, 128, 1, 4, 6)), (512, None)],  # o_proj
    (1024, 3072): [(1, GemmConfig(16, 32, 128, 4, 4, 6)), (16, GemmConfig(16, 32, 128, 4, 4, 4)),
                   (64, GemmConfig(64, 32, 128, 4, 4, 6)), (128, GemmConfig(64, 32, 128, 2, 4, 6)), (256, None),
                   (512, None)],  # down_proj
    (4096, 1024): [(1, None), (16, None), (64, GemmConfig(64, 32, 128, 1, 4, 6)), (128, None), (256, None),
                   (512, None)],  # qkv_proj
    (6144, 1024): [(512, None)],  # gate_up_proj: cuBLAS at every M swept (1..512)
    (151936, 1024): [(1, None), (16, GemmConfig(16, 128, 128, 1, 4, 3)), (64, GemmConfig(64, 128, 128, 1, 4, 4)),
                     (512, None)],  # LM head (Qwen3-0.6B): the heuristic was 1.3-1.7x slower at M >= 128
}  # fmt: skip


def heuristic_config(M: int, N: int, K: int, num_sms: int) -> GemmConfig:
    """What won most in the H200 sweeps: 16-row tiles up to M = 16, 64 up to 256, then 128; 32 columns, widened
    while there are more tiles than SMs; then K split until about one program per SM, keeping >= 2 K tiles per
    split; a deep pipeline (all of a program's loads in flight early) where shared memory allows."""
    bm = 16 if M <= 16 else 64 if M < 512 else 128
    bk = min(64 if bm == 128 else 128, max(16, triton.next_power_of_2(K)))
    bn = 32
    while triton.cdiv(M, bm) * triton.cdiv(N, bn) > num_sms and bn < 128:
        bn *= 2
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split = 1
    while split < 8 and tiles * split * 2 <= num_sms and K // (bk * split * 2) >= 2:
        split *= 2
    stage_bytes = (bm + bn) * bk * 2
    k_tiles = triton.cdiv(K, bk * split)
    stages = 6 if k_tiles >= 5 and 6 * stage_bytes <= 160 * 1024 else 4 if 4 * stage_bytes <= 200 * 1024 else 3
    return GemmConfig(bm, bn, bk, split, 4, stages)


def default_config(M: int, N: int, K: int, num_sms: int = 132) -> GemmConfig | None:
    """The config :func:`linear` uses for an [M, K] x [N, K]^T product, or None (cuBLAS) where ``TUNED`` says cuBLAS
    is as fast and for every (N, K) it has not measured (``heuristic_config`` is a starting point for a sweep there,
    not a measured win)."""
    entries = TUNED.get((N, K))
    if not entries:
        return None
    cfg = next((c for m, c in entries if M <= m), entries[-1][1])
    return None if cfg is None else cfg._replace(block_m=min(cfg.block_m, max(16, triton.next_power_of_2(M))))



# ---------------------------------------------------------------------------------------------- native / public


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference (and fallback): ``torch.nn.functional.linear``; differentiable."""
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K], weight [N, K]; the Triton kernel for small M (inference only).

    The kernel runs when M = x.numel() / K is in [1, TRITON_MAX_M] and no gradient is needed (these two are
    applicability, checked before the dispatch rule, so ``ARENO_KERNELS=triton`` still trains and still runs large
    batches through cuBLAS), :func:`use_triton` agrees (dtype fp16/bf16/fp32 shared by x, weight and bias, unit
    stride along K), and :func:`default_config` has a config (not a ``TUNED`` None: cuBLAS measured faster).
    Inference only: there is no backward and no autograd Function, on purpose.
    """
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    no_grad = not torch.is_grad_enabled() or not (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if not (1 <= M <= TRITON_MAX_M and no_grad):
        return linear_native(x, weight, bias)
    x2 = x.reshape(M, K)
    supported = (x.dtype in _FLOATS and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[1] == K
                 and x2.stride(-1) == 1 and weight.stride(-1) == 1
                 and (bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],))))  # fmt: skip
    if not use_triton(x, weight, bias, supported=supported):
        return linear_native(x, weight, bias)
    N = weight.shape[0]
    config = default_config(M, N, K, sm_count(x.device.index or 0) if x.is_cuda else 132)
    if config is None:
        return linear_native(x, weight, bias)
    y = gemm_launch(x2, weight, config, None if bias is None else bias.contiguous())
    return y.view(*x.shape[:-1], N)
