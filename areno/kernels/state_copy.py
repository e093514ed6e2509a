"""Whole per-sequence state rows copied between pools by index: ``dst[l, dst_idx[i]] = src[l, src_idx[i]]`` for every
layer l, a row being one sequence's state of one layer (the hybrids' recurrent or conv states).

A speculative rollback takes each rejecting sequence's state after its last accepted token out of the verify's
stash into its pool slot (``spec_graphs.roll_back``). As torch indexing that is a gather into a temporary and a
scatter out of it: four passes over the rows' bytes (at Qwen3.5-9B's 24 layers of 2 MB fp32 states: ~200 MB a
rejecting sequence a step). The kernel reads each row once and writes it once. Rows are contiguous within a layer
(any layer stride); ``dst`` and ``src`` of one dtype. A ``dst_idx`` of -1 skips its row (a graph's padding rows,
or rows with nothing to restore: ``spec_graphs.replay_body`` copies every row's conv state that way, the rejecting
ones only). No host sync, the native path's skipping included: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import use_triton


@triton.jit
def _copy_rows_kernel(DST, dst_sl, dst_sr, DST_IDX, SRC, src_sl, src_sr, SRC_IDX, row_elems, BLOCK: tl.constexpr):
    i, layer, blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.load(DST_IDX + i).to(tl.int64)
    s = tl.load(SRC_IDX + i).to(tl.int64)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = (offs < row_elems) & (d >= 0)  # -1: a skipped row
    x = tl.load(SRC + layer.to(tl.int64) * src_sl + s * src_sr + offs, mask=m)
    tl.store(DST + layer.to(tl.int64) * dst_sl + d * dst_sr + offs, x, mask=m)


def copy_rows_native(dst, dst_idx, src, src_idx) -> None:
    """Indexing; rows at ``dst_idx`` -1 skipped without a host sync: they write the slot and value of the first row
    that is not (or the first slot's own value when none is), so duplicate indices never race with different
    values."""
    ok = dst_idx >= 0
    d, s = dst_idx.long().clamp(min=0), src_idx.long().clamp(min=0)
    shape = (1, -1) + (1,) * (dst.dim() - 2)
    vals = torch.where(ok.view(shape), src[:, s], dst[:, d])
    j = torch.argmax(ok.to(torch.int32)).view(1)  # a 1-element index: a 0-dim one would be read on the host
    dst[:, torch.where(ok, d, d.index_select(0, j))] = torch.where(ok.view(shape), vals, vals.index_select(1, j))


def copy_rows(dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor) -> None:
    """``dst [L, S, *row]`` rows ``dst_idx`` (int ``[n]``, distinct but for -1: the row is skipped) take ``src [L,
    M, *row]`` rows ``src_idx`` (int ``[n]``), in every layer, in place."""
    if (dst.dim() < 2 or src.dim() != dst.dim() or src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]
            or dst_idx.shape != src_idx.shape or dst_idx.dim() != 1 or src.dtype != dst.dtype):
        raise ValueError(f"copy_rows: dst {tuple(dst.shape)} {dst.dtype} rows {tuple(dst_idx.shape)} from src "
                         f"{tuple(src.shape)} {src.dtype} rows {tuple(src_idx.shape)}")  # fmt: skip
    n, row = dst_idx.shape[0], dst[0, 0].numel()
    supported = dst[0, 0].is_contiguous() and src[0, 0].is_contiguous() and row > 0
    if not n:
        return
    if not use_triton(dst, src, dst_idx, src_idx, supported=supported):
        return copy_rows_native(dst, dst_idx, src, src_idx)
    block = min(4096, triton.next_power_of_2(row))
    _copy_rows_kernel[(n, dst.shape[0], triton.cdiv(row, block))](
        dst, dst.stride(0), dst.stride(1), dst_idx, src, src.stride(0), src.stride(1), src_idx, row, BLOCK=block,
        num_warps=4)  # fmt: skip
