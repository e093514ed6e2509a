"""Multi-head latent attention (MLA) decode against a paged latent KV cache, in absorbed form; and the cache write.

Cache layout: ``latent_cache [num_blocks, block_size, R + P]``, one row per token shared by every head: the
normalised latent ``c`` (``R = kv_lora_rank``) then the roped key part ``k_rope`` (``P = qk_rope_head_dim``). Token j
of sequence b lives in block ``block_table[b, j // block_size]`` at offset ``j % block_size``; ``seq_lens[b]`` counts
every token of b, the new one included.

Absorbed decode: a head's key is ``[W_uk c | k_rope]`` and its value ``W_uv c`` (``W_uk [d_nope, R]``, ``W_uv
[d_v, R]``: the head's rows of ``kv_b_proj``), so with ``q_lat = q_nope W_uk`` (per head, done by the caller)

    s_j = (q_lat . c_j + q_rope . k_rope_j) * scale,   o_lat = softmax(s) @ c,   o = W_uv o_lat (caller)

i.e. multi-query attention with one shared K/V head: K the whole row (R + P wide), V its first R columns.
``mla_decode`` takes ``q = [q_lat | q_rope]  [B, H, R + P]`` and returns ``o_lat [B, H, R]``.

Tiling: one program per (sequence, head tile, split): BLOCK_H query heads (all of them for H <= 32) against BLOCK_N
cache rows at a time through an online softmax, each row found through the block table, so a row is read once per
head tile instead of once per head. Keys split over NUM_SPLITS programs (split-K) when there are too few sequences
to fill the GPU; ``paged_attention``'s merge kernel combines the partial (O, LSE). The split count comes from shapes
only, no host sync happens and every buffer has a static shape: the call can be captured in a CUDA graph.
Decode bytes (the bound): sum_b seq_lens[b] * (R + P) * element size (576 * 2 = 1,152 bytes a token for Ling 3 in
bf16, against 2 * H * 192 * 2 = 24,576 for K/V expanded per head at H = 32), plus q and o.
FLOPs: 2 * H * sum_b seq_lens[b] * (2R + P).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from areno.kernels.attention.paged import num_splits_for, paged_reduce_kernel
from areno.kernels.dispatch import interpreting, use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
MAX_RANK = 1024


@triton.jit
def _mla_decode_kernel(
    Q, CACHE, BLOCK_TABLE, SEQ_LENS, O, PART_O, PART_LSE, qk_scale,
    stride_qb, stride_qh, stride_cb, stride_cs, stride_bt, stride_ob, stride_oh, H,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h_tile = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    seq_len = tl.load(SEQ_LENS + b)

    offs_h = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_ok, p_ok = offs_r < RANK, offs_p < ROPE
    q_row = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_c = tl.load(q_row + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_p = tl.load(q_row + RANK + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)

    # this program's keys: NUM_SPLITS chunks of whole BLOCK_N tiles
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < hi
        page = tl.load(BLOCK_TABLE + b * stride_bt + cols // PAGE_SIZE, mask=col_ok, other=0).to(tl.int64)
        row = CACHE + page[:, None] * stride_cb + (cols % PAGE_SIZE)[:, None] * stride_cs
        c = tl.load(row + offs_r[None, :], mask=col_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        kp = tl.load(row + RANK + offs_p[None, :], mask=col_ok[:, None] & p_ok[None, :], other=0.0)
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PREC)
        s = tl.dot(q_p, tl.trans(kp), s, input_precision=DOT_PREC) * qk_scale
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_mask = h_ok[:, None] & r_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(O + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_r[None, :],
                 o.to(O.dtype.element_ty), mask=out_mask)
    else:
        # partials in paged_attention's merge layout: PART_O [B, H, NUM_SPLITS, R] fp32, PART_LSE [B, H, NUM_SPLITS]
        part = (b.to(tl.int64) * H + offs_h) * NUM_SPLITS + split
        tl.store(PART_O + part[:, None] * RANK + offs_r[None, :], o, mask=out_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(PART_LSE + part, lse, mask=h_ok)


@triton.jit
def _store_latent_kernel(X, CACHE, SLOTS, stride_x, stride_cb, stride_cs, W: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         BLOCK_W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    offs = tl.arange(0, BLOCK_W)
    x = tl.load(X + t * stride_x + offs, mask=offs < W)
    tl.store(CACHE + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs + offs, x, mask=offs < W)


# ---------------------------------------------------------------------------------------------------------------
# Launchers


def _tile_config(heads: int, rank: int, dtype: torch.dtype):
    """(BLOCK_H, BLOCK_N, num_warps, num_stages). The accumulator is BLOCK_H x R fp32 (32 x 512: 64 registers a thread
    at 8 warps); a cache tile BLOCK_N x (R + P) per stage in shared memory."""
    block_h = max(triton.next_power_of_2(heads), 16)
    if interpreting():  # the interpreter pays per program and per loop step, not per element
        return min(block_h, 64), 32, 4, 1
    block_n = 32 if dtype != torch.float32 and rank <= 512 else 16
    return min(block_h, 32), block_n, 8 if rank >= 256 else 4, 2


def mla_decode_triton(q, cache, block_table, seq_lens, rank, scale, num_splits=None, config=None, split_rows=None):
    B, H, W = q.shape
    page = cache.shape[1]
    block_h, block_n, warps, stages = config or _tile_config(H, rank, q.dtype)
    h_tiles = triton.cdiv(H, block_h)
    if num_splits is None:
        num_splits = num_splits_for(q, (split_rows or B) * h_tiles, block_table.shape[1] * page)
    out = q.new_empty((B, H, rank))
    if B == 0:
        return out
    if num_splits > 1:
        part_o = torch.empty((B, H, num_splits, rank), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((B, H, num_splits), device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = out  # unused
    _mla_decode_kernel[(B, h_tiles * num_splits)](
        q, cache, block_table, seq_lens, out, part_o, part_lse, scale * _LOG2E,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0), out.stride(0),
        out.stride(1), H, RANK=rank, ROPE=W - rank, BLOCK_R=max(triton.next_power_of_2(rank), 16),
        BLOCK_P=max(triton.next_power_of_2(W - rank), 16), PAGE_SIZE=page, BLOCK_H=block_h, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if num_splits > 1:
        split_pad = triton.next_power_of_2(num_splits)
        block_r = max(triton.next_power_of_2(rank), 16)
        block_hr = min(triton.next_power_of_2(H), max(16384 // (split_pad * block_r), 1))
        paged_reduce_kernel[(B, triton.cdiv(H, block_hr))](
            part_o, part_lse, out, out, H, out.stride(0), out.stride(1), D=rank, BLOCK_D=block_r,
            NUM_SPLITS=num_splits, SPLIT_PAD=split_pad, BLOCK_H=block_hr, HAS_SINKS=False,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------------
# Native paths and the reference


def mla_decode_reference(q, latent_cache, block_table, seq_lens, *, kv_lora_rank, softmax_scale):
    """Obviously-correct oracle: gather each sequence's rows through the block table, then plain softmax attention
    with K = the rows and V = their first ``kv_lora_rank`` columns, in the inputs' dtype (pass float64). Host-syncs."""
    page = latent_cache.shape[1]
    out = q.new_zeros((q.shape[0], q.shape[1], kv_lora_rank))
    for b, n in enumerate(seq_lens.tolist()):
        j = torch.arange(n, device=q.device)
        rows = latent_cache[block_table[b].long()[j // page], j % page]  # [n, R + P]
        p = torch.softmax(q[b] @ rows.T * softmax_scale, dim=-1)
        out[b] = p @ rows[:, :kv_lora_rank]
    return out


def mla_decode_native(q, cache, block_table, seq_lens, rank, scale):
    """Tensorised PyTorch path, no host sync (graph-capturable): gather the whole block table, mask, softmax.
    Memory O(B * max_blocks * block_size * (R + P)): for tests and small batches."""
    B, H, W = q.shape
    cap = block_table.shape[1] * cache.shape[1]
    compute = torch.float32 if (q.dtype != torch.float64 and not q.is_cuda) else q.dtype
    rows = cache[block_table.long().clamp(min=0)].reshape(B, cap, W).to(compute)
    s = torch.einsum("bhw,bjw->bhj", q.to(compute), rows)
    s = (s if s.dtype == torch.float64 else s.float()) * scale
    keep = (torch.arange(cap, device=q.device)[None, :] < seq_lens.long()[:, None])[:, None, :]  # [B, 1, cap]
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    p = torch.where(keep.any(-1, keepdim=True), p, torch.zeros_like(p)).to(compute)
    return torch.einsum("bhj,bjr->bhr", p, rows[..., :rank]).to(q.dtype)


def store_latent_native(x, cache, slot_mapping):
    """No host sync (graph-capturable): a row at slot -1 rewrites the first valid row's slot with that row's values
    (slot 0 with what it holds when no row is valid), so every slot written gets one value."""
    ok = slot_mapping >= 0
    first = torch.argmax(ok.to(torch.int32)).view(1)
    slots = torch.where(ok, slot_mapping, slot_mapping.index_select(0, first)).long().clamp(min=0)
    blk, off = slots // cache.shape[1], slots % cache.shape[1]
    val = torch.where(ok[:, None], x, x.index_select(0, first)).to(cache.dtype)
    cache[blk, off] = torch.where(ok.any(), val, cache[blk, off])


# ---------------------------------------------------------------------------------------------------------------
# Public entry points


def _check(q, cache, block_table, seq_lens, rank):
    if cache.dim() != 3:
        raise ValueError(f"mla_decode: latent_cache must be [num_blocks, block_size, R + P], got {tuple(cache.shape)}")
    if q.dim() != 3 or q.shape[2] != cache.shape[2]:
        raise ValueError(f"mla_decode: q must be [B, H, R + P] as wide as the cache rows, got q {tuple(q.shape)}, "
                         f"cache {tuple(cache.shape)}")
    if not 0 < rank < q.shape[2]:
        raise ValueError(f"mla_decode: kv_lora_rank={rank} must be in (0, {q.shape[2]}) (the row is R + P wide)")
    if q.dtype != cache.dtype:
        raise ValueError(f"mla_decode: q and the cache must share a dtype, got {q.dtype}, {cache.dtype}")
    if block_table.dim() != 2 or seq_lens.shape != (block_table.shape[0],) or q.shape[0] != block_table.shape[0]:
        raise ValueError(f"mla_decode: q [B, ..], block_table [B, max_blocks] and seq_lens [B] expected, got "
                         f"{tuple(q.shape)}, {tuple(block_table.shape)}, {tuple(seq_lens.shape)}")


def mla_decode(q, latent_cache, block_table, seq_lens, *, kv_lora_rank, softmax_scale=None, num_splits=None,
               split_rows=None):
    """One decode query per sequence against the paged latent cache (see the module docstring); returns the latent
    output ``o_lat [B, H, kv_lora_rank]`` in q's dtype (no gradients).

    ``q [B, H, R + P]``: the absorbed nope part ``q_nope W_uk`` then the roped part; ``latent_cache [num_blocks,
    block_size, R + P]``; ``block_table`` int32 ``[B, max_blocks]``; ``seq_lens`` int32 ``[B]`` (at least 1).
    ``softmax_scale`` defaults to ``1/sqrt(R + P)`` (MLA passes ``1/sqrt(d_nope + d_rope)``); ``num_splits``
    overrides the split-K factor (default: chosen from shapes, for ``split_rows`` sequences where given, as
    ``paged_attention``'s).
    """
    _check(q, latent_cache, block_table, seq_lens, kv_lora_rank)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    supported = q.dtype in _FLOATS and kv_lora_rank <= MAX_RANK and q.shape[-1] - kv_lora_rank <= 256
    if not use_triton(q, latent_cache, supported=supported):
        return mla_decode_native(q, latent_cache, block_table, seq_lens, kv_lora_rank, scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if latent_cache.stride(-1) != 1:
        raise ValueError("mla_decode: latent_cache needs a unit stride on its last dim")
    return mla_decode_triton(q, latent_cache, block_table.to(torch.int32), seq_lens.to(torch.int32), kv_lora_rank,
                              scale, num_splits, split_rows=split_rows)


def store_latent(x, latent_cache, slot_mapping):
    """Write rows ``x [T, R + P]`` into ``latent_cache [num_blocks, block_size, R + P]`` at flat slots
    ``block * block_size + offset``; slot -1 skips."""
    if x.dim() != 2 or latent_cache.dim() != 3 or x.shape[1] != latent_cache.shape[2]:
        raise ValueError(f"store_latent: x [T, W] must match the cache's [.., .., W], got {tuple(x.shape)}, "
                         f"cache {tuple(latent_cache.shape)}")
    if slot_mapping.shape != (x.shape[0],):
        raise ValueError(f"store_latent: slot_mapping must be [T={x.shape[0]}], got {tuple(slot_mapping.shape)}")
    if x.dtype != latent_cache.dtype:
        raise ValueError(f"store_latent: x dtype {x.dtype} differs from the cache's {latent_cache.dtype}")
    if not use_triton(x, latent_cache, supported=latent_cache.stride(-1) == 1):
        store_latent_native(x, latent_cache, slot_mapping)
        return
    x = x if x.stride(-1) == 1 else x.contiguous()
    if x.shape[0] == 0:
        return
    W = x.shape[1]
    _store_latent_kernel[(x.shape[0],)](
        x, latent_cache, slot_mapping, x.stride(0), latent_cache.stride(0), latent_cache.stride(1), W=W,
        PAGE_SIZE=latent_cache.shape[1], BLOCK_W=triton.next_power_of_2(W),
    )  # fmt: skip
