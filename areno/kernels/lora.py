"""Grouped LoRA for serving many adapters in one batch (the "punica" idea): each token row adds its own adapter's delta.

    y[m] += scale[s] * (x[m] @ A[s]^T) @ B[s]^T     with s = idx[m]; idx[m] = -1: the row adds nothing

over stacked adapter weights ``A [L, R, K]`` (shrink) and ``B [L, N, R]`` (expand), ``L`` adapter slots of rank ``R``
(a lower rank zero-padded), ``scale [L]`` fp32 (alpha / r). ``y`` is updated in place and may be a column slice of a
wider output (a fused projection's rows): only its last stride must be 1.

Tiling: the shrink runs on a grid (row blocks, slots); the program of slot s loads its block's indices and does its
work only when a row of the block uses s (a prefill chunk's rows share one adapter; a decode block mixes a few), so
each row's product is computed by exactly one program, with ``tl.dot`` on the block's rows (rows of other slots
masked to zero) and an fp32 accumulator. The intermediate ``x A^T`` (fp32 ``[M, R]``) is rounded to the weights'
dtype before the expand, as PEFT's unmerged ``lora_B(lora_A(x))`` does; the expand (grid: row blocks, column blocks,
slots) adds ``scale * t B^T`` to ``y`` in fp32 and stores it in ``y``'s dtype. Shapes are static (no host sync): the
index tensor can be a CUDA-graph input.

The native reference (also the test oracle's twin and the CPU path) loops over the slots with the same roundings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64


@triton.jit
def _slot_rows(IDX, M, slot, BLOCK_M: tl.constexpr):
    """This program's block of rows (int64), which of them use ``slot``, and whether any does."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    hit = rmask & (tl.load(IDX + rows, mask=rmask, other=-1) == slot)
    return rows.to(tl.int64), hit, tl.max(hit.to(tl.int32), axis=0) > 0


@triton.jit
def _lora_shrink_kernel(
    X, A, IDX, T, M, K, R, sxm, sa0, sa1,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(1)
    rows64, hit, any_hit = _slot_rows(IDX, M, slot, BLOCK_M)
    if any_hit:
        rr = tl.arange(0, BLOCK_R)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + kk) < K
            x = tl.load(X + rows64[:, None] * sxm + (k0 + kk)[None, :], mask=hit[:, None] & kmask[None, :], other=0.0)
            a = tl.load(A + slot * sa0 + rr[None, :] * sa1 + (k0 + kk)[:, None],
                        mask=(rr < R)[None, :] & kmask[:, None], other=0.0)
            if IEEE:
                acc += tl.dot(x, a.to(x.dtype), input_precision="ieee")
            else:
                acc += tl.dot(x, a.to(x.dtype))
        tl.store(T + rows64[:, None] * R + rr[None, :], acc, mask=hit[:, None] & (rr < R)[None, :])


@triton.jit
def _lora_expand_kernel(
    T, B, IDX, SCALE, Y, M, N, R, sym, sb0, sb1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(2)
    rows64, hit, any_hit = _slot_rows(IDX, M, slot, BLOCK_M)
    if any_hit:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        rr = tl.arange(0, BLOCK_R)
        t = tl.load(T + rows64[:, None] * R + rr[None, :], mask=hit[:, None] & (rr < R)[None, :], other=0.0)
        b = tl.load(B + slot * sb0 + cols[None, :] * sb1 + rr[:, None], mask=(rr < R)[:, None] & cmask[None, :],
                    other=0.0)
        t = t.to(B.dtype.element_ty)  # PEFT's rounding of lora_A's output
        if IEEE:
            acc = tl.dot(t, b, input_precision="ieee")
        else:
            acc = tl.dot(t, b)
        acc = acc * tl.load(SCALE + slot)
        mask = hit[:, None] & cmask[None, :]
        ptr = Y + rows64[:, None] * sym + cols[None, :]
        y = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr, (y + acc).to(Y.dtype.element_ty), mask=mask)


def lora_add_reference(y, x, a, b, scale, idx) -> torch.Tensor:
    """Native PyTorch: each slot's rows, with the kernel's roundings (fp32 products, the intermediate in ``b``'s
    dtype); ``y`` updated in place and returned."""
    for s in range(a.shape[0]):
        rows = (idx == s).nonzero().flatten()
        if rows.numel() == 0:
            continue
        t = (x[rows].float() @ a[s].float().t()).to(b.dtype)
        d = (t.float() @ b[s].float().t()) * scale[s].float()
        y[rows] = (y[rows].float() + d).to(y.dtype)
    return y


def _lora_triton(y, x, a, b, scale, idx) -> None:
    m, k = x.shape
    slots, r, _ = a.shape
    n = y.shape[1]
    if m == 0 or r == 0:
        return
    block_r = max(16, triton.next_power_of_2(r))
    ieee = x.dtype == torch.float32
    t = torch.empty(m, r, dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(triton.cdiv(m, BLOCK_M), slots)](
        x, a, idx, t, m, k, r, x.stride(0), a.stride(0), a.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, IEEE=ieee,
    )
    _lora_expand_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), slots)](
        t, b, idx, scale, y, m, n, r, y.stride(0), b.stride(0), b.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r, IEEE=ieee,
    )


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
             idx: torch.Tensor) -> torch.Tensor:
    """``y [M, N] += scale[idx] * (x [M, K] @ A[idx]^T) @ B[idx]^T`` per row, in place (rows with ``idx`` -1 are
    untouched); ``a [L, R, K]``, ``b [L, N, R]`` (contiguous last dims), ``scale [L]`` fp32, ``idx [M]`` int32.
    Returns ``y``."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or idx.shape != (x.shape[0],):
        raise ValueError(f"lora_add: x {tuple(x.shape)}, y {tuple(y.shape)} and idx {tuple(idx.shape)} need "
                         "[M, K], [M, N] and [M]")
    if a.shape[2] != x.shape[1] or b.shape[1] != y.shape[1] or a.shape[1] != b.shape[2] or a.shape[0] != b.shape[0]:
        raise ValueError(f"lora_add: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit x {tuple(x.shape)} "
                         f"and y {tuple(y.shape)}")
    supported = (x.dtype in _FLOATS and y.dtype in _FLOATS and a.dtype in _FLOATS and b.dtype == a.dtype
                 and x.stride(1) == 1 and y.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1
                 and idx.is_contiguous() and scale.is_contiguous())
    if use_triton(y, x, a, b, supported=supported):
        _lora_triton(y, x, a, b, scale, idx)
        return y
    return lora_add_reference(y, x, a, b, scale, idx)
