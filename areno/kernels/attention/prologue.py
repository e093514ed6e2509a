"""The attention prologue of a decoder layer on the inference path, fused: per-head QK RMSNorm, RoPE, KV-cache write.

Input: one token's row of the fused projection ``qkv [T, (Hq + 2 * Hkv) * D]`` = ``[q heads | k heads | v heads]``.
For every query head (norm weight ``wq``) and key head (``wk``), both norms optional (None: Llama-style, no norm):

    n = x / sqrt(mean(x^2) + eps)        (fp32, mean over D)
    x' = (w * n.to(dtype)).to(dtype)     (rms_norm's rounding: the normed value is in qkv's dtype before RoPE)
    y = rope(x')                         (NeoX rotate-halves on the first rotary_dim dims, fp32, rounded once)

then ``q = y_q [T, Hq, D]`` and ``k = y_k [T, Hkv, D]`` (new tensors), ``v`` a view ``[T, Hkv, D]`` of ``qkv``, and
the rotated k and untouched v are written to ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]`` at flat slot
``slot_mapping[t]`` (slot < 0: nothing written). The result equals ``rms_norm`` -> ``apply_rope`` ->
``store_kvcache`` (the native reference below composes exactly those), in one launch instead of five.

Inference only: there is no autograd Function. ``Attention`` calls it only with a KV cache and grad mode off (the
rollout engine runs under ``torch.inference_mode()``); called with inputs that need gradients, it raises.

Tiling: grid ``(T, 2)``: program (t, 0) rotates token t's query heads, program (t, 1) its key heads and copies its
value heads, each BLOCK_H heads at a time as [BLOCK_H, D/2] halves (plus the pass-through dims past rotary_dim).
Bytes per token: read (Hq + 2 Hkv) D, write q Hq D, k Hkv D and the cache 2 Hkv D, all in qkv's element size, so
(2 Hq + 5 Hkv) * D * bytes; with Hq=16, Hkv=8, D=128 in bf16 that is 18 KB, against 32 KB for the unfused chain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.attention.paged import store_kvcache_native
from areno.kernels.dispatch import use_triton
from areno.kernels.norm import rms_norm_native
from areno.kernels.rope import apply_rope_native

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 512


@triton.jit
def _norm_rope_heads(
    X, Y, C, W, H, c, s, eps, write_cache, sch,
    D: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, HAS_CACHE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    # X: the token's first head in qkv (heads D apart); Y: its row of the [T, H, D] output; C: its cache row.
    dtype = X.dtype.element_ty
    k = tl.arange(0, BLOCK_HALF)
    kmask = k < HALF
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        hmask = heads < H
        m = hmask[:, None] & kmask[None, :]
        x_at = X + heads[:, None] * D
        x1 = tl.load(x_at + k[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_at + HALF + k[None, :], mask=m, other=0.0).to(tl.float32)
        if BLOCK_PASS > 0:  # dims past rotary_dim: normed, not rotated
            p = tl.arange(0, BLOCK_PASS)
            pmask = p < D - 2 * HALF
            mp = hmask[:, None] & pmask[None, :]
            xp = tl.load(x_at + 2 * HALF + p[None, :], mask=mp, other=0.0).to(tl.float32)
        if HAS_NORM:
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if BLOCK_PASS > 0:
                ss += tl.sum(xp * xp, axis=1)
            rstd = tl.rsqrt(ss / D + eps)[:, None]
            w1 = tl.load(W + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(W + HALF + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
            x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            if BLOCK_PASS > 0:
                wp = tl.load(W + 2 * HALF + p, mask=pmask, other=0.0).to(tl.float32)[None, :]
                xp = (wp * (xp * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        y1 = (x1 * c - x2 * s).to(dtype)
        y2 = (x2 * c + x1 * s).to(dtype)
        y_at = Y + heads[:, None] * D
        tl.store(y_at + k[None, :], y1, mask=m)
        tl.store(y_at + HALF + k[None, :], y2, mask=m)
        if BLOCK_PASS > 0:
            tl.store(y_at + 2 * HALF + p[None, :], xp.to(dtype), mask=mp)
        if HAS_CACHE:
            c_at = C + heads[:, None] * sch
            tl.store(c_at + k[None, :], y1, mask=m & write_cache)
            tl.store(c_at + HALF + k[None, :], y2, mask=m & write_cache)
            if BLOCK_PASS > 0:
                tl.store(c_at + 2 * HALF + p[None, :], xp.to(dtype), mask=mp & write_cache)


@triton.jit
def _qkv_prologue_kernel(
    QKV, POS, COS, SIN, WQ, WK, SLOTS, Q, K, K_CACHE, V_CACHE,
    HQ, HKV, sxt, scos, skb, sks, skh, svb, svs, svh, eps,
    D: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    row = QKV + t * sxt
    pos = tl.load(POS + t).to(tl.int64)
    k = tl.arange(0, BLOCK_HALF)
    c = tl.load(COS + pos * scos + k, mask=k < HALF, other=0.0).to(tl.float32)[None, :]
    s = tl.load(SIN + pos * scos + k, mask=k < HALF, other=0.0).to(tl.float32)[None, :]
    if tl.program_id(1) == 0:
        _norm_rope_heads(
            row, Q + t * HQ * D, Q, WQ, HQ, c, s, eps, False, 0,
            D, HALF, Q_NORM, False, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS,
        )  # fmt: skip
    else:
        slot = tl.load(SLOTS + t).to(tl.int64)
        write = slot >= 0  # slot < 0: a padding row, the cache is left alone
        slot = tl.maximum(slot, 0)
        blk, off = slot // PAGE_SIZE, slot % PAGE_SIZE
        _norm_rope_heads(
            row + HQ * D, K + t * HKV * D, K_CACHE + blk * skb + off * sks, WK, HKV, c, s, eps, write, skh,
            D, HALF, K_NORM, True, BLOCK_HK, BLOCK_HALF, BLOCK_PASS,
        )  # fmt: skip
        if write:
            v_at = row + (HQ + HKV) * D
            cache_at = V_CACHE + blk * svb + off * svs
            d = tl.arange(0, BLOCK_D)
            for h0 in range(0, HKV, BLOCK_HK):
                heads = h0 + tl.arange(0, BLOCK_HK)
                m = (heads < HKV)[:, None] & (d < D)[None, :]
                v = tl.load(v_at + heads[:, None] * D + d[None, :], mask=m)
                tl.store(cache_at + heads[:, None] * svh + d[None, :], v, mask=m)


def _split(qkv, num_heads, num_kv_heads, head_dim):
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)


def qkv_prologue_launch(
    qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, q_norm_w, k_norm_w, eps, k_cache, v_cache, slot_mapping
):
    """Launch the fused kernel (inputs already checked by :func:`qkv_prologue`). Returns ``(q, k, v)``."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    t, d = qkv.shape[0], head_dim
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
    v = _split(qkv, num_heads, num_kv_heads, d)[2]
    if t == 0:
        return q, k, v
    half = cos.shape[1]
    block_half = triton.next_power_of_2(half)
    cap = max(1, 2048 // block_half)  # heads per tile: at most ~4K elements (two halves) in flight per program
    rest = d - 2 * half
    _qkv_prologue_kernel[(t, 2)](
        qkv, positions.contiguous(), cos, sin,
        q_norm_w if q_norm_w is not None else qkv, k_norm_w if k_norm_w is not None else qkv,
        slot_mapping.contiguous(), q, k, k_cache, v_cache,
        num_heads, num_kv_heads, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), float(eps),
        D=d, HALF=half, PAGE_SIZE=k_cache.shape[1], Q_NORM=q_norm_w is not None, K_NORM=k_norm_w is not None,
        BLOCK_HQ=min(triton.next_power_of_2(num_heads), cap), BLOCK_HK=min(triton.next_power_of_2(num_kv_heads), cap),
        BLOCK_HALF=block_half, BLOCK_PASS=triton.next_power_of_2(rest) if rest > 0 else 0,
        BLOCK_D=triton.next_power_of_2(d), num_warps=4,
    )  # fmt: skip
    return q, k, v


def qkv_prologue_native(
    qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, q_norm_w, k_norm_w, eps, k_cache, v_cache, slot_mapping
):
    """The unfused chain (rms_norm -> apply_rope -> store_kvcache natives): the oracle and the CPU path."""
    q, k, v = _split(qkv, num_heads, num_kv_heads, head_dim)
    if q_norm_w is not None:
        q = rms_norm_native(q, q_norm_w, eps).to(qkv.dtype)
    if k_norm_w is not None:
        k = rms_norm_native(k, k_norm_w, eps).to(qkv.dtype)
    q, k = apply_rope_native(q, positions, cos, sin), apply_rope_native(k, positions, cos, sin)
    store_kvcache_native(k, v, k_cache, v_cache, slot_mapping)
    return q, k, v


def check_prologue_inputs(who, qkv, positions, cos, sin, weights, hq, hkv, d):
    """The checks qkv_prologue and qk_norm_rope share: qkv's shape and dtype, positions, cos/sin tables, the two
    norm weights (``weights``: {argument name: tensor or None}); errors name ``who`` and the argument."""
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * d:
        raise ValueError(
            f"{who}: qkv must be [T, (Hq + 2*Hkv) * D] = [T, {(hq + 2 * hkv) * d}] for Hq={hq}, "
            f"Hkv={hkv}, D={d}, got {tuple(qkv.shape)}"
        )
    if qkv.dtype not in _FLOATS:
        raise ValueError(f"{who}: qkv must be fp16/bf16/fp32, got {qkv.dtype}")
    t = qkv.shape[0]
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{who}: positions must be int32/int64 [T={t}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if cos.dim() != 2 or cos.shape != sin.shape or not 0 < 2 * cos.shape[1] <= d:
        raise ValueError(
            f"{who}: cos and sin must both be [max_position, rotary_dim/2] with rotary_dim in "
            f"(0, D={d}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    for name, w in weights.items():
        if w is not None and (w.shape != (d,) or w.dtype not in _FLOATS):
            raise ValueError(f"{who}: {name} must be a float [D={d}] or None, got {w.dtype} {tuple(w.shape)}")


def _check(qkv, positions, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, slot_mapping, hq, hkv, d):
    check_prologue_inputs("qkv_prologue", qkv, positions, cos, sin, {"q_norm_w": q_norm_w, "k_norm_w": k_norm_w},
                          hq, hkv, d)
    t = qkv.shape[0]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (hkv, d):
        raise ValueError(
            f"qkv_prologue: k_cache/v_cache must both be [num_blocks, block_size, Hkv={hkv}, D={d}], "
            f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(
            f"qkv_prologue: the caches ({k_cache.dtype}, {v_cache.dtype}) must have qkv's dtype {qkv.dtype}"
        )
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"qkv_prologue: slot_mapping must be int32/int64 [T={t}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    tensors = (qkv, positions, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, slot_mapping)
    devices = {x.device for x in tensors if x is not None}
    if len(devices) > 1:
        raise ValueError(f"qkv_prologue: tensors on different devices: {sorted(map(str, devices))}")
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (qkv, q_norm_w, k_norm_w)):
        raise ValueError(
            "qkv_prologue: inference only (no autograd); call it under torch.no_grad() or "
            "torch.inference_mode(), or use rms_norm/apply_rope/store_kvcache for training"
        )


def qkv_prologue(
    qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, q_norm_w, k_norm_w, eps, k_cache, v_cache, slot_mapping
):
    """Per-head RMSNorm (weights optional), NeoX RoPE and the paged KV-cache write of ``qkv``, in one launch.

    ``qkv [T, (Hq + 2*Hkv) * D]`` (any row stride) holds this rank's heads (local counts under TP); ``cos``/``sin``
    fp32 ``[P, rotary_dim/2]``; positions lie in ``[0, P)`` (not checked: no host sync). Returns ``q [T, Hq, D]``
    and ``k [T, Hkv, D]`` (new) and ``v``, a ``[T, Hkv, D]`` view of ``qkv``. No gradients (see module docstring).
    """
    heads = (num_heads, num_kv_heads, head_dim)
    tensors = (qkv, positions, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, slot_mapping)
    _check(*tensors, *heads)
    supported = head_dim <= MAX_HEAD_DIM and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    run = qkv_prologue_launch if use_triton(*tensors, supported=supported) else qkv_prologue_native
    return run(qkv, positions, cos, sin, *heads, q_norm_w, k_norm_w, eps, k_cache, v_cache, slot_mapping)
