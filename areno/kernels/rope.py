"""Rotary position embedding (NeoX style, rotate halves): cos/sin tables, Triton kernel, native reference, autograd.

With r = rotary_dim and theta_i = position * inv_freq_i (i < r/2), for every head of a token:

    x1 = x[..., :r/2]    x2 = x[..., r/2:r]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin       out[..., r:] = x[..., r:]

The backward applies the transposed rotation (sin -> -sin). Math in fp32, output in x's dtype. Tables are fp32
[max_position, r/2], built exactly as Hugging Face builds inv_freq (default, "linear", Llama 3 and YaRN scaling; YaRN's
attention factor multiplies the tables, as transformers multiplies its cos/sin).
One program rotates a block of heads of one token; it reads its cos/sin row once: 2 * T * H * D * bytes moved.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rope_kernel(
    X, Y, POS, COS, SIN,
    H, HALF, PASS, sxt, sxh, syt, syh, scos,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    k = tl.arange(0, BLOCK_HALF)
    kmask = k < HALF
    pos = tl.load(POS + t).to(tl.int64)
    c = tl.load(COS + pos * scos + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(SIN + pos * scos + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:  # the transpose of a rotation is the rotation by -theta
        s = -s
    heads64 = heads.to(tl.int64)
    xrow = X + t * sxt + heads64[:, None] * sxh
    yrow = Y + t * syt + heads64[:, None] * syh
    mask = hmask[:, None] & kmask[None, :]
    x1 = tl.load(xrow + k[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + HALF + k[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(yrow + k[None, :], (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(yrow + HALF + k[None, :], (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:  # dims beyond the rotary part are copied through
        p = tl.arange(0, BLOCK_PASS)
        pmask = hmask[:, None] & (p < PASS)[None, :]
        v = tl.load(xrow + 2 * HALF + p[None, :], mask=pmask, other=0.0)
        tl.store(yrow + 2 * HALF + p[None, :], v.to(Y.dtype.element_ty), mask=pmask)


def rope_launch(x, positions, cos, sin, backward=False):
    """Rotate ``x [T, H, D]`` by the angles of ``positions`` (the inverse rotation with ``backward``)."""
    assert x.dim() == 3, f"apply_rope: x must be [tokens, heads, head_dim], got shape {tuple(x.shape)}"
    assert x.dtype in _FLOATS, f"apply_rope: x must be fp16/bf16/fp32, got {x.dtype}"
    t, h, d = x.shape
    assert cos.dim() == 2 and cos.shape == sin.shape, (
        f"apply_rope: cos and sin must both be [max_position, rotary_dim/2], got {tuple(cos.shape)}, {tuple(sin.shape)}"
    )
    half = cos.shape[1]
    assert 0 < 2 * half <= d, f"apply_rope: rotary_dim {2 * half} must be in (0, head_dim={d}]"
    assert positions.shape == (t,), f"apply_rope: positions must be [{t}], got {tuple(positions.shape)}"
    assert positions.dtype in (torch.int32, torch.int64), (
        f"apply_rope: positions must be int32/int64, got {positions.dtype}"
    )
    assert x.device == positions.device == cos.device == sin.device, "apply_rope: tensors on different devices"
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    if x.stride(2) != 1:
        x = x.contiguous()
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    positions = positions.contiguous()
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(h), max(1, 2048 // block_half))
    rest = d - 2 * half
    block_pass = triton.next_power_of_2(rest) if rest > 0 else 0
    grid = (t, triton.cdiv(h, block_h))
    _rope_kernel[grid](
        x, y, positions, cos, sin,
        h, half, rest, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0),
        BACKWARD=backward, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass, num_warps=4,
    )  # fmt: skip
    return y


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, cos, sin):
        ctx.save_for_backward(positions, cos, sin)
        return rope_launch(x, positions, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        positions, cos, sin = ctx.saved_tensors
        return rope_launch(dy, positions, cos, sin, backward=True), None, None, None


def apply_rope_native(x, positions, cos, sin):
    """Plain PyTorch reference (fp32 math); differentiable with respect to x."""
    half = cos.shape[-1]
    idx = positions.long()
    math_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for a float64 reference
    c = cos[idx].to(math_dtype).unsqueeze(1)
    s = sin[idx].to(math_dtype).unsqueeze(1)
    xf = x.to(math_dtype)
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, xf[..., 2 * half :]], dim=-1)
    return out.to(x.dtype)


def apply_rope(x, positions, cos, sin):
    """NeoX rotary embedding of ``x [T, H, D]`` at int ``positions [T]`` with fp32 tables ``[P, rotary_dim/2]``.

    Positions must lie in ``[0, P)``; they are not checked on the Triton path (no host sync)."""
    supported = x.dim() == 3 and x.dtype in _FLOATS and 0 < 2 * cos.shape[-1] <= x.shape[-1]
    if use_triton(x, positions, cos, sin, supported=supported):
        return RopeFunction.apply(x, positions, cos, sin)
    return apply_rope_native(x, positions, cos, sin)


# ---- tables ----------------------------------------------------------------------------------------------------


def _scaling_type(rope_scaling) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type")) or "default"


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """fp32 [rotary_dim/2] inverse frequencies, computed on the CPU with the same ops as Hugging Face."""
    assert rotary_dim > 0 and rotary_dim % 2 == 0, f"rope: rotary_dim must be a positive even number, got {rotary_dim}"
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = _scaling_type(rope_scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]
    if kind == "llama3":
        missing = [
            key
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if key not in rope_scaling
        ]
        if missing:
            raise ValueError(f"rope: llama3 rope_scaling is missing {missing}; got {rope_scaling}")
        factor = rope_scaling["factor"]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated smoothly.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "proportional":  # Gemma 4's global layers: rotary_dim is the head dim; the rest rotate by angle 0
        angles = int(rope_scaling.get("partial_rotary_factor", 1.0) * rotary_dim // 2)
        exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / rotary_dim
        rotated = 1.0 / (float(base) ** exponents)
        inv = torch.cat([rotated, torch.zeros(rotary_dim // 2 - angles, dtype=torch.float32)])
        return inv / rope_scaling.get("factor", 1.0)
    if kind == "yarn":
        return _yarn_inv_freq(rotary_dim, float(base), rope_scaling)
    raise NotImplementedError(f"rope: rope_type {kind!r} is not supported (default, linear, llama3, yarn and "
                              "proportional are)")


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN: interpolated (``/ factor``) low frequencies, extrapolated high ones, a linear ramp between the
    correction dims of ``beta_fast`` / ``beta_slow`` rotations (floored/ceiled unless ``truncate`` is false)."""
    missing = [key for key in ("factor", "original_max_position_embeddings") if scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope: yarn rope_scaling is missing {missing}; got {scaling}")
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(rope_scaling: dict | None) -> float:
    """The factor transformers multiplies cos/sin by: YaRN's ``attention_factor`` (given, or from ``factor`` and
    ``mscale``/``mscale_all_dim``); 1 for the other scalings."""
    if _scaling_type(rope_scaling) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor, m, m_all = rope_scaling["factor"], rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    return float(yarn_mscale(factor, m) / yarn_mscale(factor, m_all)) if m and m_all else yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``); DeepSeek-V3 also folds its square into the
    softmax scale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_cos_sin(rotary_dim, max_position, base, *, rope_scaling=None, device=None):
    """fp32 ``(cos, sin)`` tables of shape ``[max_position, rotary_dim // 2]`` for :func:`apply_rope`."""
    inv_freq = rope_inv_freq(rotary_dim, base, rope_scaling).to(device)
    angles = torch.arange(max_position, device=device, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    scale = rope_attention_factor(rope_scaling)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def rope_params_from_config(config) -> tuple[float, dict | None, int]:
    """``(base, rope_scaling, rotary_dim)`` from a Hugging Face config object or dict.

    Reads transformers 5's ``rope_parameters`` dict (``rope_theta``, ``rope_type``, ``partial_rotary_factor``, ...)
    or the older top-level fields (``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``). ``rope_scaling`` is
    None for plain RoPE, otherwise a dict with ``rope_type`` and its parameters."""

    def get(key, default=None):
        if isinstance(config, dict):
            value = config.get(key, default)
        else:
            value = getattr(config, key, default)
        return default if value is None else value

    params = dict(get("rope_parameters", None) or {})
    old_scaling = dict(get("rope_scaling", None) or {})
    if not params:
        params = old_scaling
    base = params.get("rope_theta", get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    head_dim = get("head_dim", None) or get("hidden_size") // get("num_attention_heads")
    rotary_dim = int(head_dim * partial)

    kind = _scaling_type(params)
    if kind == "default":
        scaling = None
    else:
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
        scaling["rope_type"] = kind
        if kind == "llama3" and "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = get("max_position_embeddings")
    return float(base), scaling, rotary_dim
