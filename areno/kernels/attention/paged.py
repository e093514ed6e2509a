"""Attention against a paged KV cache (decode, multi-token verify, prefill over a cached prefix), and the cache write.

Cache layout: ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]``; token j of sequence b lives in block
``block_table[b, j // block_size]`` at offset ``j % block_size``. ``seq_lens[b]`` counts every token of b, the new
ones included. Decode: ``q [B, Hq, D]``, one query per sequence. With ``cu_seqlens_q``: ``q [Tq, Hq, D]``, the
queries of b are its LAST ``cu_seqlens_q[b+1] - cu_seqlens_q[b]`` tokens, causal aligned to the end of seq_lens[b].

Tiling: one program per (sequence, KV head, split, query tile). Its M dimension packs the query heads of one GQA
group (padded to a power of two) times the query tokens of the tile, so K/V of a head are read once per group;
keys stream BLOCK_N at a time through an online softmax, each key row found through the block table. When there are
too few (sequence, head) programs to fill the GPU, the keys are split over NUM_SPLITS programs (split-K) whose
partial (O, LSE) a second kernel merges. The split count comes from shapes only (never seq_lens values), no host
sync happens and every buffer has a static shape, so the call can be captured in a CUDA graph.
Decode bytes (the bound): sum_b seq_lens[b] * Hkv * D * 2 (K and V) * element size, plus q and o.
``window`` (sliding window, as ``attention``): key blocks left of a tile's window are skipped, so decode reads
O(W) keys. ``sinks [Hq]`` (as ``attention``): added to each row's softmax denominator at the end of the kernel, or
once in the split-K combine.

FP8 cache (``k_scale``/``v_scale`` given; the engine's ``--kv-cache-dtype fp8``, whose cache entries are ``(k_cache,
v_cache, k_scale, v_scale)``: ``paged_kv`` splits one): the caches hold float8_e4m3fn and each token's head vector has
its own fp32 scale, ``k_scale``/``v_scale [num_blocks, block_size, Hkv]``; ``store_kvcache`` quantises on write (``s =
max(amax over D, EPS) / 448``, E4M3 round to nearest even, kernels/fp8.py's rounding) and the attention kernel widens
each E4M3 tile as it loads it (to fp16 under 16-bit queries, one instruction a pair; bf16 would take a scalar conversion
per element more) and multiplies a key's scale into its column of q k^T, a value's (over the tile's largest, which
scales the product) into its column of p (the dots in fp16, q and p rounded to it): half a bf16 cache's bytes (plus 4
per D). Round trip per element: within 2^-4 |x| (2^-10 s below E4M3's smallest normal).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from areno.kernels._device import sm_count
from areno.kernels.attention.common import add_sink
from areno.kernels.attention.packed import attention_reference, check_sinks, check_window
from areno.kernels.dispatch import interpreting, use_triton
from areno.kernels.fp8 import EPS, FP8, FP8_MAX, quantize_rows_fp8, round_e4m3

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
MAX_SPLITS = 32


@triton.jit(do_not_specialize=["stride_bt"])  # the table's width varies per eager step: one variant for all
def _paged_attn_kernel(
    Q, K_CACHE, V_CACHE, K_SCALE, V_SCALE, BLOCK_TABLE, SEQ_LENS, CU_Q, O, PART_O, PART_LSE, SINKS, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_ot, stride_oh, stride_sb, stride_ss, GROUP, WINDOW,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_CU: tl.constexpr,
    DOT_PREC: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SCALE: tl.constexpr,
    KV_F16: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hk = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    TOKENS: tl.constexpr = BLOCK_M // GROUP_PAD
    t0 = tl.program_id(2) * TOKENS
    seq_len = tl.load(SEQ_LENS + b)
    if HAS_CU:
        q_start = tl.load(CU_Q + b)
        Lq = tl.load(CU_Q + b + 1) - q_start
    else:
        q_start = b
        Lq = 1
    if t0 >= Lq:
        return
    diag = seq_len - Lq  # query t sees keys j <= t + diag

    rows = tl.arange(0, BLOCK_M)
    t = t0 + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_ok = (t < Lq) & (g < GROUP)
    h = hk * GROUP + g
    tok = (q_start + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + tok[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if KV_F16:  # FP8 cache, 16-bit queries: the dots run in fp16, which E4M3 widens to in one instruction per pair
        q = q.to(tl.float16)  # (to bf16 it takes a scalar conversion per element more: F2F, a quarter of the loop)

    # Keys this tile needs, cut into NUM_SPLITS chunks of whole BLOCK_N blocks; this program takes one. With a
    # sliding window, whole blocks left of the tile's first query's window are skipped (query t sees keys
    # t + diag - WINDOW < j <= t + diag).
    kv_hi = tl.minimum(tl.maximum(tl.minimum(t0 + TOKENS, Lq) + diag, 0), seq_len)
    if HAS_WINDOW:
        kv_lo = tl.minimum(tl.maximum(t0 + diag - WINDOW + 1, 0) // BLOCK_N * BLOCK_N, kv_hi)
    else:
        kv_lo = 0
    chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * chunk
    hi = tl.minimum(lo + chunk, kv_hi)

    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < hi
        page = tl.load(BLOCK_TABLE + b * stride_bt + cols // PAGE_SIZE, mask=col_ok, other=0).to(tl.int64)
        within = cols % PAGE_SIZE
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K_CACHE + page[:, None] * stride_kb + within[:, None] * stride_ks + hk * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        if HAS_SCALE:  # FP8 cache: one scale per (slot, KV head), scales [num_blocks, PAGE_SIZE, Hkv], unit head stride
            # A key's scale multiplies its column of q k^T (and a value's scale its column of p) after the dot: the
            # E4M3 tile only widens to q's dtype (exactly), no fp32 pass over it
            scale_at = page * stride_sb + within * stride_ss + hk
            k_scale = tl.load(K_SCALE + scale_at, mask=col_ok, other=0.0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * (k_scale * qk_scale)[None, :]
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        keep = col_ok[None, :] & (cols[None, :] <= t[:, None] + diag)
        if HAS_WINDOW:
            keep = keep & (cols[None, :] > t[:, None] + diag - WINDOW)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_CACHE + page[:, None] * stride_vb + within[:, None] * stride_vs + hk * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        if HAS_SCALE:  # the value scales relative to the tile's largest go into p (p stays in [0, 1]: an fp16 p
            # times a small scale would fall below fp16's normals), the largest multiplies the product
            v_scale = tl.load(V_SCALE + scale_at, mask=col_ok, other=0.0)
            v_top = tl.max(v_scale, 0)
            v_top = tl.where(v_top > 0.0, v_top, 1.0)
            p = p * (v_scale / v_top)[None, :]
            v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC) * v_top
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    if HAS_SINKS and NUM_SPLITS == 1:  # (split-K: the combine adds the sink once)
        sink = tl.load(SINKS + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        acc, l_i, m_i = add_sink(acc, l_i, m_i, sink)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(O + tok[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                 o.to(O.dtype.element_ty), mask=out_mask)
    else:
        # partials: PART_O [T, Hq, NUM_SPLITS, D] fp32, PART_LSE [T, Hq, NUM_SPLITS] (log2 units, -inf if empty)
        hq_total = tl.num_programs(1) // NUM_SPLITS * GROUP
        part = (tok * hq_total + h) * NUM_SPLITS + split
        tl.store(PART_O + part[:, None] * D + offs_d[None, :], o, mask=out_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(PART_LSE + part, lse, mask=row_ok)


@triton.jit
def paged_reduce_kernel(PART_O, PART_LSE, O, SINKS, Hq, stride_ot, stride_oh, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_PAD: tl.constexpr,
                        BLOCK_H: tl.constexpr, HAS_SINKS: tl.constexpr):
    # per (token, head): o = sum_s 2^(lse_s - max) o_s / (sum_s 2^(lse_s - max) [+ 2^(sink - max)]); BLOCK_H heads
    # per program
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    part = (t * Hq + offs_h[:, None]) * NUM_SPLITS + s[None, :]  # [BLOCK_H, SPLIT_PAD]
    ok = (offs_h[:, None] < Hq) & (s[None, :] < NUM_SPLITS)
    lse = tl.load(PART_LSE + part, mask=ok, other=float("-inf"))
    m = tl.max(lse, 1)
    if HAS_SINKS:
        sink = tl.load(SINKS + offs_h, mask=offs_h < Hq, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[:, None])
    w_sum = tl.sum(w, 1)
    if HAS_SINKS:
        w_sum += tl.exp2(sink - m)
    o_part = tl.load(PART_O + part[:, :, None] * D + offs_d[None, None, :],
                     mask=ok[:, :, None] & (offs_d[None, None, :] < D), other=0.0)
    o = tl.sum(o_part * w[:, :, None], 1) / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]
    tl.store(O + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=(offs_h[:, None] < Hq) & (offs_d[None, :] < D))


@triton.jit
def _quantize_heads(x, scale_ptrs, h_ok, EPS: tl.constexpr, FP8_MAX: tl.constexpr):
    # x [BLOCK_H, BLOCK_D] (zeros outside): per row s = max(amax, EPS) / 448 stored at scale_ptrs, x / s rounded to
    # E4M3 (still fp32: the cast to fp8 is then exact)
    x = x.to(tl.float32)
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), EPS), FP8_MAX)
    tl.store(scale_ptrs, s, mask=h_ok)
    return round_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, s[:, None]), -FP8_MAX), FP8_MAX))


@triton.jit
def _store_kvcache_kernel(K, V, K_CACHE, V_CACHE, K_SCALE, V_SCALE, SLOTS, stride_kt, stride_kh, stride_vt,
                          stride_vh, stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch, stride_sb,
                          stride_ss, HKV,
                          D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                          QUANT: tl.constexpr, EPS: tl.constexpr, FP8_MAX: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    if QUANT:
        at = blk * stride_sb + off * stride_ss + offs_h
        k = _quantize_heads(k, K_SCALE + at, offs_h < HKV, EPS, FP8_MAX)
        v = _quantize_heads(v, V_SCALE + at, offs_h < HKV, EPS, FP8_MAX)
    tl.store(K_CACHE + blk * stride_kb + off * stride_ks + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(K_CACHE.dtype.element_ty), mask=mask)
    tl.store(V_CACHE + blk * stride_vb + off * stride_vs + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(V_CACHE.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers



def num_splits_for(q: torch.Tensor, programs: int, capacity: int) -> int:
    """Split-K factor from static shapes: enough (sequence, head, split) programs for ~2 waves on the GPU, each
    split at least 256 keys of the table's capacity; a power of two so few kernel variants compile."""
    if not q.is_cuda:
        return 1
    want = triton.cdiv(2 * sm_count(q.device.index or 0), max(programs, 1))
    splits = min(want, max(capacity // 256, 1), MAX_SPLITS)
    return 1 << (max(splits, 1).bit_length() - 1)  # round down to a power of two


def _tile_config(group_pad: int, multi_token: bool, head_dim: int, fp8: bool = False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): decode is bandwidth-bound, so small M and a deep-enough key tile.
    An FP8 cache's tiles are half the bytes: at one query a sequence (decode), twice the keys a tile and one more
    stage keep as many bytes in flight (bench/attention.py --rollout-sweep --kv-cache-dtypes bf16,fp8, H100, 256 x
    384 keys: 100 us against 158 us with the bf16 cache's config, and bf16's 138 us); the multi-token tiles (64
    query rows) keep bf16's config, not swept."""
    if interpreting():  # big tiles: the interpreter pays per program and per loop step, not per element
        return max(64 if multi_token else 16, group_pad), 32, 4, 1
    block_m = max(64 if multi_token else 16, group_pad)
    block_n = 64 if head_dim <= 128 else 32
    if fp8 and not multi_token:
        return block_m, 2 * block_n, 4, 3
    return block_m, block_n, 4, 2


def paged_attention_triton(q, k_cache, v_cache, block_table, seq_lens, scale, cu_q, max_q, num_splits=None,
                            config=None, window=None, sinks=None, k_scale=None, v_scale=None, split_rows=None):
    T, Hq, D = q.shape
    B = block_table.shape[0]
    _, page_size, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    group_pad = triton.next_power_of_2(group)
    multi = cu_q is not None
    block_m, block_n, warps, stages = config or _tile_config(group_pad, multi, D, k_scale is not None)
    block_m = max(block_m, group_pad)
    q_tiles = triton.cdiv(max_q, block_m // group_pad) if multi else 1
    if num_splits is None:  # from shapes: the rows' (or ``split_rows``') programs, the keys a query tile reads
        keys = block_table.shape[1] * page_size
        keys = keys if window is None else min(keys, window + (max_q if multi else 1) + block_n)
        num_splits = num_splits_for(q, (split_rows or B) * Hkv * q_tiles, keys)
    out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    if num_splits > 1:
        part_o = torch.empty((T, Hq, num_splits, D), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((T, Hq, num_splits), device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = out  # unused
    block_d = max(triton.next_power_of_2(D), 16)
    sink_ptr = out if sinks is None else sinks.contiguous()  # (not read without sinks)
    _paged_attn_kernel[(B, Hkv * num_splits, q_tiles)](
        q, k_cache, v_cache, out if k_scale is None else k_scale, out if v_scale is None else v_scale, block_table,
        seq_lens, cu_q if multi else seq_lens, out, part_o, part_lse, sink_ptr,
        scale * _LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), out.stride(0), out.stride(1),
        *((0, 0) if k_scale is None else k_scale.stride()[:2]), group, window or 0, D=D, BLOCK_D=block_d,
        PAGE_SIZE=page_size, GROUP_PAD=group_pad, BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, HAS_CU=multi, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, HAS_SCALE=k_scale is not None,
        KV_F16=k_scale is not None and q.dtype != torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if num_splits > 1:
        split_pad = triton.next_power_of_2(num_splits)
        block_h = min(triton.next_power_of_2(Hq), max(16384 // (split_pad * block_d), 1))
        paged_reduce_kernel[(T, triton.cdiv(Hq, block_h))](
            part_o, part_lse, out, sink_ptr, Hq, out.stride(0), out.stride(1), D=D, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, SPLIT_PAD=split_pad, BLOCK_H=block_h, HAS_SINKS=sinks is not None,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------------
# Native paths and the reference


def paged_attention_reference(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, cu_seqlens_q=None,
                              window=None, sinks=None):
    """Obviously-correct oracle: gather each sequence's keys through the block table, then plain attention in the
    inputs' dtype (pass float64); ``window`` and ``sinks`` as in ``attention_reference``. Host-syncs; for tests."""
    B = block_table.shape[0]
    page = k_cache.shape[1]
    lens = seq_lens.tolist()
    cu_q = list(range(B + 1)) if cu_seqlens_q is None else cu_seqlens_q.tolist()
    ks, vs = [], []
    for b in range(B):
        j = torch.arange(lens[b], device=q.device)
        blocks = block_table[b].long()[j // page]
        ks.append(k_cache[blocks, j % page])
        vs.append(v_cache[blocks, j % page])
    cu_k = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    return attention_reference(q[: cu_q[-1]], torch.cat(ks), torch.cat(vs), torch.tensor(cu_q), cu_k, causal=True,
                               softmax_scale=softmax_scale, window=window, sinks=sinks)


def paged_attention_native(q, k_cache, v_cache, block_table, seq_lens, scale, cu_q, max_q, window=None,
                           sinks=None, k_scale=None, v_scale=None):
    """Tensorised PyTorch path, no host sync (graph-capturable): gather the whole block table, mask, softmax.
    Memory is O(B * max_blocks * block_size), fine for tests and small batches. Assumes cu_seqlens_q[-1] == Tq."""
    T, Hq, D = q.shape
    B, max_blocks = block_table.shape
    _, page, Hkv, _ = k_cache.shape
    cap = max_blocks * page
    compute = torch.float32 if (q.dtype != torch.float64 and not q.is_cuda) else q.dtype
    blocks = block_table.long().clamp(min=0)
    kg = k_cache[blocks].reshape(B, cap, Hkv, D).to(compute)
    vg = v_cache[blocks].reshape(B, cap, Hkv, D).to(compute)
    if k_scale is not None:  # FP8 cache: dequantised in fp32, then the compute dtype (the kernel scales its dots)
        kg = (kg.float() * k_scale[blocks].reshape(B, cap, Hkv, 1)).to(q.dtype).to(compute)
        vg = (vg.float() * v_scale[blocks].reshape(B, cap, Hkv, 1)).to(q.dtype).to(compute)
    if cu_q is None:
        seq, pos, Lmax = torch.arange(B, device=q.device), torch.zeros(B, dtype=torch.long, device=q.device), 1
        lq = torch.ones(B, dtype=torch.long, device=q.device)
    else:
        cu = cu_q.long()
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=q.device), right=True).clamp(max=B - 1)
        pos = torch.arange(T, device=q.device) - cu[seq]
        lq, Lmax = cu[1:] - cu[:-1], max_q
    qb = q.new_zeros((B, Lmax, Hq, D), dtype=compute)
    qb[seq, pos] = q.to(compute)
    qb = qb.view(B, Lmax, Hkv, Hq // Hkv, D)
    score = torch.float64 if compute == torch.float64 else torch.float32
    s = torch.einsum("btkgd,bjkd->bkgtj", qb, kg).to(score) * scale
    j = torch.arange(cap, device=q.device)
    limit = torch.arange(Lmax, device=q.device)[None, :] + (seq_lens.long() - lq)[:, None]  # [B, Lmax]
    keep = (j[None, None, :] <= limit[:, :, None]) & (j[None, None, :] < seq_lens.long()[:, None, None])
    if window is not None:
        keep = keep & (j[None, None, :] > limit[:, :, None] - window)
    keep = keep[:, None, None]  # [B, 1, 1, Lmax, cap]
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
        p = torch.where(keep.any(-1, keepdim=True), p, torch.zeros_like(p)).to(compute)
    else:  # one more column per head (its value 0), dropped after the softmax
        sink = sinks.to(score).view(1, Hkv, Hq // Hkv, 1, 1).expand(B, -1, -1, Lmax, 1)
        p = torch.softmax(torch.cat([s, sink], -1), dim=-1)[..., :-1].to(compute)
    out = torch.einsum("bkgtj,bjkd->btkgd", p, vg).reshape(B, Lmax, Hq, D)
    return out[seq, pos].to(q.dtype)


def store_kvcache_native(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """No host sync (graph-capturable): a row at slot -1 rewrites the first valid row's slot with that row's K/V (slot 0
    with what it holds when no row is valid), so every slot written gets one value however many rows write it.
    With scales (FP8 cache): each (token, head) row quantised, its scale written beside it."""
    ok = slot_mapping >= 0
    first = torch.argmax(ok.to(torch.int32)).view(1)
    slots = torch.where(ok, slot_mapping, slot_mapping.index_select(0, first)).long().clamp(min=0)
    blk, off = slots // k_cache.shape[1], slots % k_cache.shape[1]
    keep, any_ok = ok[:, None, None], ok.any()
    for new, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        val = torch.where(keep, new, new.index_select(0, first))
        if scales is not None:
            val, s = quantize_rows_fp8(val)
            scales[blk, off] = torch.where(any_ok, s, scales[blk, off])
            val, cache = val.view(torch.uint8), cache.view(torch.uint8)  # torch.where has no fp8 kernel on the CPU
        cache[blk, off] = torch.where(any_ok, val.to(cache.dtype), cache[blk, off])


# ---------------------------------------------------------------------------------------------------------------
# Public entry points


def paged_kv(kv_cache) -> tuple:
    """An engine cache entry, ``(k_cache, v_cache)`` or FP8's ``(k_cache, v_cache, k_scale, v_scale)``, as
    ``(k_cache, v_cache, scales)``: ``scales`` the keyword arguments ``store_kvcache``/``paged_attention`` take."""
    if len(kv_cache) == 2:
        return kv_cache[0], kv_cache[1], {}
    k_cache, v_cache, k_scale, v_scale = kv_cache
    return k_cache, v_cache, {"k_scale": k_scale, "v_scale": v_scale}


def check_fp8_cache(k_cache, v_cache, k_scale, v_scale, what: str) -> None:
    """Scales given together, with float8_e4m3fn caches, as fp32 ``[num_blocks, block_size, Hkv]`` with a unit head
    stride and the same strides for K and V (a prefix of wider rows' heads may be a view: Gemma 4's per-layer Hkv)."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{what}: k_scale and v_scale go together (an FP8 cache has both)")
    if k_scale is None:
        return
    for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)):
        if (cache.dtype != FP8 or sc.dtype != torch.float32 or sc.shape != cache.shape[:3] or sc.stride(-1) != 1
                or sc.stride() != k_scale.stride()):
            raise ValueError(f"{what}: an FP8 cache is float8_e4m3fn with fp32 scales [num_blocks, block_size, Hkv] "
                             f"(unit head stride, K's strides = V's), got {cache.dtype} {tuple(cache.shape)}, "
                             f"{sc.dtype} {tuple(sc.shape)} strides {sc.stride()}")


def _check(q, k_cache, v_cache, block_table, seq_lens, cu_q, fp8=False):
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention: k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"paged_attention: q must be [tokens, Hq, D] with Hq a multiple of Hkv and D matching the "
                         f"cache, got q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if not fp8 and (q.dtype != k_cache.dtype or q.dtype != v_cache.dtype):
        raise ValueError(f"paged_attention: q and the caches must share a dtype, got {q.dtype}, {k_cache.dtype}")
    if block_table.dim() != 2 or seq_lens.shape != (block_table.shape[0],):
        raise ValueError(f"paged_attention: block_table [B, max_blocks] and seq_lens [B] expected, got "
                         f"{tuple(block_table.shape)}, {tuple(seq_lens.shape)}")
    if cu_q is None and q.shape[0] != block_table.shape[0]:
        raise ValueError(f"paged_attention: decode needs one query per sequence, q has {q.shape[0]} rows for "
                         f"{block_table.shape[0]} sequences (pass cu_seqlens_q for several per sequence)")
    if cu_q is not None and cu_q.shape != (block_table.shape[0] + 1,):
        raise ValueError(f"paged_attention: cu_seqlens_q must be [B+1], got {tuple(cu_q.shape)}")


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, cu_seqlens_q=None,
                    max_seqlen_q=None, num_splits=None, window=None, sinks=None, k_scale=None, v_scale=None,
                    split_rows=None):
    """Attention of new queries against a paged KV cache; returns ``[Tq, Hq, D]`` in q's dtype (no gradients).

    ``q [B, Hq, D]`` (decode) or, with ``cu_seqlens_q`` int32 ``[B+1]``, ``[Tq, Hq, D]`` (each sequence's last
    tokens; ``max_seqlen_q``, a host int, bounds the per-sequence query count and defaults to Tq).
    ``num_splits`` overrides the split-K factor (default: chosen from shapes, for ``split_rows`` sequences where
    given: a speculative verify's K + 1 decode rows a sequence pass their sequence count, so each row's keys are
    split, and rounded, as a plain decode step of those sequences splits them). ``window``: sliding-window size in
    keys (as ``attention_reference``); the kernel skips key blocks left of it. ``sinks``: ``[Hq]`` per-head sink
    logits (as ``attention_reference``): the kernel adds the sink to each row's softmax denominator (split-K: once,
    in the combine). ``k_scale``/``v_scale``: an FP8 cache's scales (module docstring).
    """
    check_fp8_cache(k_cache, v_cache, k_scale, v_scale, "paged_attention")
    _check(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, fp8=k_scale is not None)
    window = check_window(window, True)
    sinks = check_sinks(sinks, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    max_q = q.shape[0] if max_seqlen_q is None else int(max_seqlen_q)
    supported = q.dtype in _FLOATS and q.shape[-1] <= MAX_HEAD_DIM
    if not use_triton(q, k_cache, v_cache, supported=supported):
        return paged_attention_native(q, k_cache, v_cache, block_table, seq_lens, scale, cu_seqlens_q, max_q, window,
                                      sinks, k_scale, v_scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: k_cache/v_cache need a unit stride on head_dim")
    cu_q = None if cu_seqlens_q is None else cu_seqlens_q.to(torch.int32)
    return paged_attention_triton(q, k_cache, v_cache, block_table.to(torch.int32), seq_lens.to(torch.int32),
                                   scale, cu_q, max_q, num_splits, window=window, sinks=sinks, k_scale=k_scale,
                                   v_scale=v_scale, split_rows=split_rows)


def warm_paged_attention(k_cache, v_cache, num_q_heads: int, features=((False, None),), k_scale=None, v_scale=None,
                         q_dtype=None) -> int:
    """Compile every kernel variant ``paged_attention`` can pick for this cache and query head count (each split-K
    factor, one query per sequence and several), so that no serving step stalls on a JIT compile (hundreds of ms
    each). ``features``: the (sliding window?, sinks dtype or None) pairs the model's layers call with (each is its
    own variant; default: full attention without sinks). An FP8 cache: its scales and the queries' ``q_dtype`` (the
    model's), for the dequantising variants. Reads block 0 of the caches, writes nothing to them; returns how many
    variants ran (0 off the GPU)."""
    check_fp8_cache(k_cache, v_cache, k_scale, v_scale, "warm_paged_attention")
    q_dtype = q_dtype or k_cache.dtype
    if not (k_cache.is_cuda and use_triton(k_cache, v_cache, supported=q_dtype in _FLOATS)):
        return 0
    _, page_size, hkv, d = k_cache.shape
    if num_q_heads < hkv or num_q_heads % hkv or d > MAX_HEAD_DIM:
        return 0
    dev = k_cache.device
    table = torch.zeros((1, 3), dtype=torch.int32, device=dev)
    seq_lens = torch.full((1,), min(2, page_size), dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=dev)
    runs = 0
    for windowed, sinks_dtype in features:
        sinks = None if sinks_dtype is None else torch.zeros(num_q_heads, dtype=sinks_dtype, device=dev)
        splits = 1
        while splits <= MAX_SPLITS:
            for multi in (False, True):
                q = torch.zeros((2 if multi else 1, num_q_heads, d), dtype=q_dtype, device=dev)
                paged_attention_triton(q, k_cache, v_cache, table, seq_lens, 1.0, cu if multi else None, q.shape[0],
                                        splits, window=1 if windowed else None, sinks=sinks,
                                        k_scale=k_scale, v_scale=v_scale)
                runs += 1
            splits *= 2
    return runs


def store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Write ``k/v [T, Hkv, D]`` into the caches at flat slots ``block * block_size + offset``; slot -1 skips.
    ``k_scale``/``v_scale``: an FP8 cache's scales, each (token, head) row quantised on write."""
    check_fp8_cache(k_cache, v_cache, k_scale, v_scale, "store_kvcache")
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"store_kvcache: k/v [T, Hkv, D] must match the caches' [.., .., Hkv, D], got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"store_kvcache: slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if k_scale is None and (k.dtype != k_cache.dtype or v.dtype != v_cache.dtype):
        raise ValueError(f"store_kvcache: k/v dtype {k.dtype} differs from the cache's {k_cache.dtype}")
    if not use_triton(k, v, k_cache, v_cache, supported=k_cache.stride(-1) == 1):
        store_kvcache_native(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    T, Hkv, D = k.shape
    if T == 0:
        return
    quant = k_scale is not None
    _store_kvcache_kernel[(T,)](
        k, v, k_cache, v_cache, k_scale if quant else k, v_scale if quant else v, slot_mapping, k.stride(0),
        k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), *((0, 0) if not quant else k_scale.stride()[:2]), Hkv, D=D, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(Hkv),
        BLOCK_D=triton.next_power_of_2(D), QUANT=quant, EPS=EPS, FP8_MAX=FP8_MAX,
    )  # fmt: skip
