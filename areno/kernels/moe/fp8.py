"""FP8 routed experts (FP8 rollout, issue 41): grouped fp8 x fp8 GEMMs over the expert-sorted (token, slot) pairs,
their launchers, the native reference and ``fused_moe_fp8`` (which ``fused_moe`` runs when given FP8 weights).

Format: kernels/fp8.py's, per expert: ``w13`` float8_e4m3fn ``[E, 2I, H]`` (gate rows, then up rows) and ``w2``
``[E, H, I]`` as ``Fp8Weight`` stacks, one fp32 scale per 128 x 128 block of each expert's matrix (scales
``[E, ceil(2I/128), ceil(H/128)]`` and ``[E, ceil(H/128), ceil(I/128)]``: DeepSeek-V3's / Qwen3-FP8's expert layout,
the gate and up halves sharing a block row only when I is not a multiple of 128); activations per token and 128
columns (kernels/fp8.py's activation kernel, reused: x once per token before gate_up, h once per pair before down).

    y[t] = sum_j w[t, j] * Q(act(x'[t] W13'_e^T |gate) * (x'[t] W13'_e^T |up)) W2'_e^T,   e = topk_ids[t, j]

with x' = Q(x) and Q the per-token-per-128-column quantise-dequantise, W' the dequantised weights; g|u rounded to
x's dtype, the activation and h as the bf16 kernel rounds them (moe/gemm.py's ``gate_up``), each pair's output in
x's dtype, summed over its k slots.

Triton path: the pairs sorted by expert (``sort_by_expert``) and walked as moe/gemm.py's grouped kernels walk them
(``block_rows``: BLOCK_M blocks cut per expert from ``counts``, no host sync, CUDA-graph capturable). One kernel,
``_fp8_experts_kernel``: the K loop reads fp8 x fp8 in BLOCK_K steps (BLOCK_K divides 128, so a step lies in one
scale group) and promotes each partial dot to the fp32 accumulator with its scales, ``acc += dot(a, b) s_a s_b``
(kernels/fp8.py's GEMM); ``GATE_UP``: two accumulators (gate, up) over an I tile, the activation and the product
fused in the epilogue, h written by sorted row; else (down): the routing weight applied, written by pair. Weight
bytes read per expert hit: 2I H + H I (half of bf16's) + scales. Decode sizes (at most 16 pairs per expert on
average) take one fixed config (narrow N tiles: more programs on the few experts a small batch touches); larger
batches a 64 x 128 tile; ``configs`` pins them (tests, bench/moe.py).

Native path (CPU; the test oracle): every expert over every pair, masked (no host sync), operands dequantised to
fp32, the same roundings. Inference only: no gradient through the rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import interpreting, use_triton
from areno.kernels.fp8 import (
    BLOCK,
    Fp8Weight,
    dequantize_act_fp8,
    dequantize_weight_fp8,
    quantize_act_fp8,
    quantize_act_fp8_native,
)
from areno.kernels.moe.common import ACTIVATIONS, check_activation, check_inputs, sort_by_expert
from areno.kernels.moe.gemm import block_rows

__all__ = ["fused_moe_fp8", "fused_moe_fp8_native", "fp8_gate_up", "fp8_down"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_ACT = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def _scaled_dot(acc, a, b, sa, sb):
    return acc + tl.dot(a, b) * (sa[:, None] * sb[None, :])


@triton.jit
def _load_b(b_ptrs, ks, k_left, EVEN_K: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] weight tile, zero past K (``k_left``: K less the step's start) unless EVEN_K."""
    if EVEN_K:
        return tl.load(b_ptrs)
    else:
        return tl.load(b_ptrs, mask=(ks < k_left)[:, None], other=0.0)


@triton.jit(do_not_specialize=["M"])
def _fp8_experts_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, order_ptr, counts_ptr, scale_ptr, out_ptr,
                        M, E, N, K, G, NW, NB, TOP_K,
                        GATE_UP: tl.constexpr, ACT: tl.constexpr, GATHER_A: tl.constexpr, SCALE: tl.constexpr,
                        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    # a fp8 [*, K] (rows by token if GATHER_A, else by sorted row) with scales as [*, G]; w fp8 [E, NW, K] with
    # scales ws [E, NB, G]. GATE_UP (NW = 2N): out [M, N] by sorted row = act(a W_gate^T) * (a W_up^T); else (NW = N):
    # out [M, N] by pair = (scale[pair] *) a W^T.
    expert, pid_n, rows, pair, tok, mask_m = block_rows(
        order_ptr, counts_ptr, M, tl.cdiv(N, BLOCK_N), E, TOP_K, BLOCK_M, BLOCK_E, GROUP_M)
    if expert >= E:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        cols = offs_n.to(tl.int64)
    else:
        cols = (offs_n % N).to(tl.int64)  # past the edge: reread valid columns (the store masks)
    arow = tok if GATHER_A else rows
    ks = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    a_ptrs = a_ptr + arow[:, None] * K + ks[None, :]
    g_ptrs = w_ptr + e64 * NW * K + cols[None, :] * K + ks[:, None]  # [BLOCK_K, BLOCK_N] view of W^T
    u_ptrs = g_ptrs + N * K  # the up rows (GATE_UP)
    as_ptrs = as_ptr + arow * G
    gs_ptrs = ws_ptr + e64 * NB * G + (cols // GROUP) * G
    us_ptrs = ws_ptr + e64 * NB * G + ((cols + N) // GROUP) * G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        g = (kb * BLOCK_K) // GROUP
        k_left = K - kb * BLOCK_K
        sa = tl.load(as_ptrs + g)
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(ks < k_left)[None, :], other=0.0)
        acc = _scaled_dot(acc, a, _load_b(g_ptrs, ks, k_left, EVEN_K), sa, tl.load(gs_ptrs + g))
        if GATE_UP:
            acc_u = _scaled_dot(acc_u, a, _load_b(u_ptrs, ks, k_left, EVEN_K), sa, tl.load(us_ptrs + g))
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dt = out_ptr.dtype.element_ty
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    if GATE_UP:
        gf = acc.to(dt).to(tl.float32)
        if ACT == 0:
            act = gf * tl.sigmoid(gf)
        else:  # tanh-approximated GELU, tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)  # sqrt(2 / pi)
            act = gf * tl.sigmoid(2.0 * z)
        act = act.to(dt).to(tl.float32)  # rounded like the activation's output in x's dtype
        h = act * acc_u.to(dt).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], h.to(dt), mask=mask)
    else:
        if SCALE:
            acc = acc * tl.load(scale_ptr + pair).to(tl.float32)[:, None]
        tl.store(out_ptr + pair[:, None] * N + offs_n[None, :], acc.to(dt), mask=mask)


# ---------------------------------------------------------------------------------------------- launchers

_INTERP = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
# decode: weight-bandwidth bound (as moe/gemm.py's decode configs, BLOCK_K one scale group: 128 fp8 bytes a row)
_DECODE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
_DECODE_GATE_UP = dict(_DECODE, BLOCK_N=32)
_LARGE = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
_LARGE_GATE_UP = dict(_LARGE, BLOCK_N=64)  # two accumulators


def _config(M: int, E: int, gate_up: bool, configs: dict | None) -> dict:
    key = "gate_up" if gate_up else "down"
    if configs and key in configs:
        return configs[key]
    if interpreting():
        return _INTERP
    if M <= 16 * E:
        return _DECODE_GATE_UP if gate_up else _DECODE
    return _LARGE_GATE_UP if gate_up else _LARGE


def _launch(a, w: Fp8Weight, order, counts, top_k: int, out, N: int, *, gate_up: bool, activation: str = "silu",
            scale=None, gather_a: bool = False, configs=None):  # fmt: skip
    """Quantise ``a`` per row and 128 columns, then the grouped fp8 GEMM into ``out``."""
    aq, a_s = quantize_act_fp8(a)
    M, E, K = order.numel(), counts.numel(), a.shape[1]
    cfg = _config(M, E, gate_up, configs)
    assert BLOCK % cfg["BLOCK_K"] == 0, f"moe fp8: BLOCK_K must divide {BLOCK}: {cfg}"
    grid = ((triton.cdiv(M, cfg["BLOCK_M"]) + min(E, M)) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _fp8_experts_kernel[grid](
        aq, a_s, w.qweight, w.scale, order, counts, out if scale is None else scale, out,
        M, E, N, K, a_s.shape[1], w.qweight.shape[1], w.scale.shape[1], top_k,
        GATE_UP=gate_up, ACT=_ACT[activation], GATHER_A=gather_a, SCALE=scale is not None,
        EVEN_K=K % cfg["BLOCK_K"] == 0, EVEN_N=N % cfg["BLOCK_N"] == 0, GROUP=BLOCK,
        BLOCK_E=triton.next_power_of_2(E), **cfg)  # fmt: skip
    return out


def fp8_gate_up(x, w13: Fp8Weight, order, counts, top_k: int, activation: str = "silu", configs=None):
    """Sorted-row ``h = act(x' Wg'^T) * (x' Wu'^T)`` ``[M, I]`` in x's dtype (x quantised per token)."""
    I = w13.qweight.shape[1] // 2
    h = torch.empty(order.numel(), I, dtype=x.dtype, device=x.device)
    return _launch(x, w13, order, counts, top_k, h, I, gate_up=True, activation=activation, gather_a=True,
                   configs=configs)  # fmt: skip


def fp8_down(h, w2: Fp8Weight, order, counts, top_k: int, topk_weights, configs=None):
    """Per pair ``w * h' W2'^T`` ``[M, H]`` in h's dtype (h by sorted row, quantised per row)."""
    H = w2.qweight.shape[1]
    y = torch.empty(order.numel(), H, dtype=h.dtype, device=h.device)
    return _launch(h, w2, order, counts, top_k, y, H, gate_up=False, scale=topk_weights, configs=configs)


def _triton(x, w13, w2, topk_weights, topk_ids, activation, configs=None):
    T, H = x.shape
    k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, w13.qweight.shape[0])
    h = fp8_gate_up(x, w13, order, counts, k, activation, configs)
    y_pair = fp8_down(h, w2, order, counts, k, topk_weights.reshape(-1), configs)
    return y_pair.view(T, k, H).sum(dim=1) if k > 1 else y_pair


# ---------------------------------------------------------------------------------------------- native, public


def _fake_quant(t: torch.Tensor) -> torch.Tensor:
    return dequantize_act_fp8(*quantize_act_fp8_native(t))


def fused_moe_fp8_native(x, w13: Fp8Weight, w2: Fp8Weight, topk_weights, topk_ids, *, activation: str = "silu"):
    """The reference: every expert over every pair (masked: no host sync), operands dequantised to fp32, x and h
    quantised per row and 128 columns, the Triton path's roundings (g|u, the activation, h, each pair's output in
    x's dtype, then the sum over slots)."""
    T, H = x.shape
    k, dt, act = topk_ids.shape[1], x.dtype, ACTIVATIONS[activation]
    ids = topk_ids.reshape(-1)
    xs = _fake_quant(x)[torch.arange(T * k, device=x.device) // k]  # [T*k, H] by pair
    w = topk_weights.reshape(-1, 1).float()
    y = torch.zeros(T * k, H, dtype=torch.float32, device=x.device)
    for e in range(w13.qweight.shape[0]):
        gate, up = (xs @ dequantize_weight_fp8(Fp8Weight(w13.qweight[e], w13.scale[e])).T).to(dt).chunk(2, dim=-1)
        h = _fake_quant((act(gate) * up).to(dt))
        o = (h @ dequantize_weight_fp8(Fp8Weight(w2.qweight[e], w2.scale[e])).T) * w
        y = torch.where((ids == e)[:, None], o, y)
    return y.to(dt).view(T, k, H).sum(dim=1)


def check_fp8_inputs(x, w13: Fp8Weight, w2: Fp8Weight, topk_weights, topk_ids):
    check_inputs(x, w13.qweight, w2.qweight, topk_weights, topk_ids)
    for name, w in (("w13", w13), ("w2", w2)):
        E, n, kk = w.qweight.shape
        want = (E, -(-n // BLOCK), -(-kk // BLOCK))
        assert tuple(w.scale.shape) == want, f"fused_moe: {name}'s FP8 scales must be {want}, got {w.scale.shape}"
    if not x.is_floating_point() or x.dtype not in _FLOATS:
        raise ValueError(f"fused_moe: FP8 experts take fp16/bf16/fp32 x, got {x.dtype}")
    if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
        raise ValueError("fused_moe with FP8 experts is inference-only (no gradient through fp8 rounding): call it "
                         "under no_grad")


def fused_moe_fp8(x: torch.Tensor, w13: Fp8Weight, w2: Fp8Weight, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, activation: str = "silu", configs: dict | None = None) -> torch.Tensor:
    """Routed experts on FP8 weights (module docstring) as ``[T, H]`` in x's dtype: the Triton kernels or the native
    reference. ``configs`` (``{"gate_up": {...}, "down": {...}}``) pins the Triton tiles (tests, benchmarks)."""
    check_activation(activation)
    check_fp8_inputs(x, w13, w2, topk_weights, topk_ids)
    tensors = (x, w13.qweight, w2.qweight, topk_weights, topk_ids)
    if not use_triton(*tensors, supported=True) or x.shape[0] == 0:
        return fused_moe_fp8_native(x, w13, w2, topk_weights, topk_ids, activation=activation)
    w13 = Fp8Weight(w13.qweight.contiguous(), w13.scale.contiguous())
    w2 = Fp8Weight(w2.qweight.contiguous(), w2.scale.contiguous())
    return _triton(x.contiguous(), w13, w2, topk_weights.contiguous(), topk_ids.contiguous(), activation, configs)
