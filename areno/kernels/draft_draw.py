"""A speculative draft's token draw from its distribution ``q [B, V]`` (fp32 probabilities, ``sampling_probs``): the
Gumbel-max race on the sampler's Philox noise, in float64 as the engine's exact rejection sampling defines it,

    token = argmax_j  log q_j - log(-log u_j),   u_j = (bits_j + 0.5) 2^-32,

``bits_j`` word ``j % 4`` of Philox4x32-10 keyed by the row's 64-bit seed at counter (j // 4, offset lo, offset hi,
0) (``sampler.philox_bits``); ties go to the lowest index (``torch.argmax``'s). A zero probability never wins.

The native composition (``draw_native``, the test oracle and the CPU's path) materialises the bits as int64 and the
scores as float64, about forty passes over ``[B, V]`` in 8-byte elements: at a 152k vocabulary and 64 rows, ~15 GB
a draft step (byte count of the ops, CPU), linear in the rows. The kernel reads q once: a program takes ROWS rows x
one vocabulary split in tiles of 4Q columns (Q Philox calls), keeps a per-lane best score and its column, and
writes the split's best; the splits are merged on the device (max, then the lowest column among equal scores). No
host sync, fixed shapes per (B, V): CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels._device import sm_count
from areno.kernels.dispatch import interpreting, use_triton
from areno.kernels.sampler import philox_bits

_BIG = 2**31 - 1


@triton.jit(do_not_specialize=["B"])
def _draw_kernel(q_ptr, stride_q, seed_ptr, off_ptr, best_ptr, idx_ptr, B, V, cols_per_split, ROWS: tl.constexpr,
                 Q: tl.constexpr):  # fmt: skip
    pid_s = tl.program_id(1)
    splits = tl.num_programs(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    seed = tl.broadcast_to(tl.load(seed_ptr + rows, mask=row_ok, other=0)[:, None], (ROWS, Q))
    off = tl.load(off_ptr + rows, mask=row_ok, other=0)
    c1 = tl.broadcast_to(off.to(tl.uint32)[:, None], (ROWS, Q))
    c2 = tl.broadcast_to((off >> 32).to(tl.uint32)[:, None], (ROWS, Q))
    c3 = tl.zeros((ROWS, Q), dtype=tl.uint32)
    q_row = q_ptr + rows.to(tl.int64)[:, None] * stride_q
    v_begin = pid_s * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, V)
    best_vec = tl.full([ROWS, 4 * Q], float("-inf"), dtype=tl.float64)
    idx_vec = tl.full([ROWS, 4 * Q], 2147483647, dtype=tl.int32)  # (a global is no constant to a compiled kernel)
    for v0 in range(v_begin, v_end, 4 * Q):
        c0 = tl.broadcast_to((v0 // 4 + tl.arange(0, Q)).to(tl.uint32)[None, :], (ROWS, Q))
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
        bits = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # column 4q + w <- word w of counter q
        cols = v0 + tl.arange(0, 4 * Q)
        ok = row_ok[:, None] & (cols < v_end)[None, :]
        q = tl.load(q_row + cols[None, :], mask=ok, other=0.0).to(tl.float64)
        u = (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10
        score = tl.log(q) - tl.log(-tl.log(u))
        score = tl.where(ok & (q > 0.0), score, float("-inf"))
        better = score > best_vec  # strict: a lane keeps its first (lowest-column) maximum
        best_vec = tl.where(better, score, best_vec)
        idx_vec = tl.where(better, cols[None, :], idx_vec)
    best = tl.max(best_vec, axis=1)
    best_idx = tl.min(tl.where(best_vec == best[:, None], idx_vec, 2147483647), axis=1)
    out = rows * splits + pid_s
    tl.store(best_ptr + out, best, mask=row_ok)
    tl.store(idx_ptr + out, best_idx, mask=row_ok)


def _draw_triton(q, seeds, offsets):
    B, V = q.shape
    interp = interpreting() or not q.is_cuda
    rows, qn = (min(64, triton.next_power_of_2(B)), 16) if interp else (1, 128)
    tile = 4 * qn
    if interp:
        splits = 2 if V > 2 * tile else 1
    else:  # enough programs to fill the GPU about four times over
        splits = max(1, min(triton.cdiv(4 * sm_count(q.device.index or 0), B), triton.cdiv(V, tile)))
    cols_per_split = triton.cdiv(triton.cdiv(V, splits), tile) * tile  # a multiple of 4: counters stay aligned
    splits = triton.cdiv(V, cols_per_split)
    best = torch.empty(B, splits, dtype=torch.float64, device=q.device)
    idx = torch.empty(B, splits, dtype=torch.int32, device=q.device)
    _draw_kernel[(triton.cdiv(B, rows), splits)](q, q.stride(0), seeds, offsets, best, idx, B, V, cols_per_split,
                                                 ROWS=rows, Q=qn, num_warps=4)  # fmt: skip
    top = best.max(dim=1, keepdim=True).values
    tok = torch.where(best == top, idx, _BIG).min(dim=1).values.long()
    return torch.where(tok == _BIG, 0, tok)  # a row of zeros only: argmax's 0


def draw_native(q, seeds, offsets):
    """The draw as torch ops (the oracle): Philox bits over the whole row, the float64 scores, argmax."""
    u = (philox_bits(seeds, offsets, q.shape[1]).double() + 0.5) * 2.0**-32
    return (torch.log(q.double()) - torch.log(-torch.log(u))).argmax(dim=1)


def draw_from_probs(q: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn from ``q [B, V]`` (fp32 probabilities) with the noise of (``seeds``, ``offsets``),
    int64 ``[B]`` tensors (see the module docstring); int64 tokens ``[B]``."""
    if q.dim() != 2 or seeds.shape != (q.shape[0],) or offsets.shape != (q.shape[0],):
        raise ValueError(f"draw_from_probs: q [B, V], seeds and offsets [B]; got {tuple(q.shape)}, "
                         f"{tuple(seeds.shape)}, {tuple(offsets.shape)}")  # fmt: skip
    supported = q.dtype == torch.float32 and q.stride(1) == 1 and q.shape[0] > 0
    if use_triton(q, seeds, offsets, supported=supported):
        return _draw_triton(q, seeds, offsets)
    return draw_native(q, seeds, offsets)
