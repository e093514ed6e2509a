"""Routed experts: ``fused_moe`` (grouped GEMMs over tokens sorted by expert, forward and backward) and the routers.

    y[t] = sum_j w[t, j] * (silu(x[t] Wg_e^T) * (x[t] Wu_e^T)) W2_e^T,   e = topk_ids[t, j]
    w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]

Triton path (kernels in gemm.py):
1. Sort the M = T*k (token, slot) pairs by expert: a stable argsort of the ids plus per-expert counts. No host sync
   and no padded buffer: kernels cut each expert's rows into BLOCK_M blocks themselves from ``counts``.
2. gate_up: h = silu(x Wg^T) * (x Wu^T) per sorted row, SiLU-and-mul fused; under autograd g|u is saved (M x 2I,
   in the input dtype: cheaper than recomputing the larger GEMM in backward).
3. down: y_pair[pair] = w * h W2^T written in pair order, then a per-token sum over its k slots (deterministic,
   no atomics).
Backward: dh = dy[tok] W2 per sorted row (grouped GEMM), then one elementwise pass for the routing-weight and
SiLU-and-mul backward (-> dg|du, w*h, d w); dW2 and dW13 as per-expert row reductions (no atomics, deterministic);
dx per pair (grouped GEMM) then a per-token sum.
FLOPs: forward 2*T*k*(H*2I + I*H), backward twice that.

Native path: the per-expert loop as transformers' Qwen3MoeExperts runs it (CPU and reference), which syncs to find the
hit experts, so without gradients at decode size it runs ``fused_moe_dense`` instead (every expert over every token,
masked: no host sync, graph-capturable; the GPU's path for fp32, which the Triton path leaves to native);
``fused_moe_reference`` is a dense float64-capable oracle for tests. ``fused_moe`` dispatches through ``use_triton``.
``activation="gelu_tanh"`` (GeGLU experts, Gemma 4) runs the native path only for now (on FP8 weights
the Triton path fuses it too). FP8 weights (``Fp8Weight`` stacks: ``--rollout-dtype fp8``) go to moe/fp8.py.
Ids must lie in [0, E): they are not checked on device (that would need a sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areno.kernels.dispatch import interpreting, use_triton
from areno.kernels.fp8 import Fp8Weight
from areno.kernels.moe import gemm as moe_gemm
from areno.kernels.moe.common import ACTIVATIONS, check_activation, check_inputs, sort_by_expert
from areno.kernels.moe.fp8 import fused_moe_fp8
from areno.kernels.moe.routing import route_sigmoid_grouped_topk, route_softmax_topk

__all__ = ["fused_moe", "route_softmax_topk", "route_sigmoid_grouped_topk", "fused_moe_native", "fused_moe_dense",
           "fused_moe_reference", "sort_by_expert"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _forward(x, w13, w2, topk_weights, topk_ids, save: bool):
    T, H = x.shape
    E, I2, _ = w13.shape
    k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, E)
    w_flat = topk_weights.reshape(-1)
    h, gu = moe_gemm.gate_up(x, w13, order, counts, k, save_gu=save)
    # down projection: B_e = w2[e]^T viewed [K=I, N=H] -> strides (expert, k, n) = (H*I, 1, I)
    y_pair = moe_gemm.expert_rows(h, w2, (w2.stride(0), 1, w2.stride(1)), H, order, counts, k, scale=w_flat)
    y = y_pair.view(T, k, H).sum(dim=1) if k > 1 else y_pair
    return y, order, counts, gu


def _backward(dy, x, w13, w2, topk_weights, order, counts, gu, needs):
    T, H = x.shape
    k = topk_weights.shape[1]
    dy = dy.contiguous()
    dgu, hw, dw = moe_gemm.down_grad(dy, w2, order, counts, gu, topk_weights.reshape(-1), k)
    dx = dw13 = dw2 = None
    if needs[0]:
        # dx per pair: B_e = w13[e] viewed [K=2I, N=H] -> strides (2I*H, H, 1)
        dx_pair = moe_gemm.expert_rows(dgu, w13, (w13.stride(0), w13.stride(1), 1), H, order, counts, k)
        dx = dx_pair.view(T, k, H).sum(dim=1) if k > 1 else dx_pair
    if needs[1]:
        dw13 = moe_gemm.expert_weight_grad(dgu, x, order, counts, k, gather_a=False, gather_b=True)
    if needs[2]:
        dw2 = moe_gemm.expert_weight_grad(dy, hw, order, counts, k, gather_a=True, gather_b=False)
    dtw = dw.view(T, k).to(topk_weights.dtype) if needs[3] else None
    return dx, dw13, dw2, dtw


class FusedMoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, topk_weights, topk_ids):
        y, order, counts, gu = _forward(x, w13, w2, topk_weights, topk_ids, save=True)
        ctx.save_for_backward(x, w13, w2, topk_weights, order, counts, gu)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w13, w2, topk_weights, order, counts, gu = ctx.saved_tensors
        grads = _backward(dy, x, w13, w2, topk_weights, order, counts, gu, ctx.needs_input_grad[:4])
        return (*grads, None)


def fused_moe_native(x, w13, w2, topk_weights, topk_ids, *, activation: str = "silu"):
    """The per-expert loop, as transformers' Qwen3MoeExperts.forward runs it (host syncs on the hit experts); without
    gradients at decode size (at most ``DENSE_PAIRS_PER_EXPERT`` pairs per expert) :func:`fused_moe_dense`."""
    check_activation(activation)
    E, act = w13.shape[0], ACTIVATIONS[activation]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights))
    if not grad and topk_ids.numel() <= DENSE_PAIRS_PER_EXPERT * E:
        return fused_moe_dense(x, w13, w2, topk_weights, topk_ids, activation=activation)
    out = torch.zeros_like(x)
    mask = F.one_hot(topk_ids.long(), num_classes=E).permute(2, 1, 0)  # [E, k, T]
    for e in (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
        slot, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        o = F.linear(act(gate) * up, w2[e]) * topk_weights[tok, slot, None]
        out.index_add_(0, tok, o.to(out.dtype))
    return out


# The decode-size bound (pairs per expert) of the sync-free native path: the bound of moe_gemm's fixed decode config.
DENSE_PAIRS_PER_EXPERT = 16


def fused_moe_dense(x, w13, w2, topk_weights, topk_ids, *, activation: str = "silu"):
    """Every expert over every token, kept where the token routes to it: fixed shapes and no host sync, so a CUDA graph
    can hold it (the native path's decode step: fp32 on a GPU, which the Triton path leaves to native). E/k times the
    routed FLOPs. Experts accumulate in id order, as the per-expert loop does. No gradients."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        hit = topk_ids == e  # [T, k]
        gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
        o = F.linear(ACTIVATIONS[activation](gate) * up, w2[e]) * (topk_weights * hit).sum(dim=1, keepdim=True)
        out += torch.where(hit.any(dim=1, keepdim=True), o, 0).to(out.dtype)  # never 0 * inf for unrouted tokens
    return out


def fused_moe_reference(x, w13, w2, topk_weights, topk_ids):
    """Dense oracle in the inputs' dtype (pass float64 tensors): gathers each slot's expert weights."""
    ids = topk_ids.long()
    gu = torch.einsum("th,tkoh->tko", x, w13[ids])
    gate, up = gu.chunk(2, dim=-1)
    o = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2[ids])
    return (o * topk_weights[..., None].to(o.dtype)).sum(dim=1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu") -> torch.Tensor:
    """Routed experts: ``sum_k w_k * (silu(x Wg^T) * (x Wu^T)) W2^T`` as [T, H]; grads for x, w13, w2, weights.
    FP8 weights (``Fp8Weight`` stacks, FP8 rollout) run ``moe/fp8.py``'s ``fused_moe_fp8`` (inference only)."""
    if isinstance(w13, Fp8Weight) or isinstance(w2, Fp8Weight):
        return fused_moe_fp8(x, w13, w2, topk_weights, topk_ids, activation=activation)
    check_activation(activation)
    check_inputs(x, w13, w2, topk_weights, topk_ids)
    if activation != "silu":  # the Triton kernels fuse SiLU-and-mul only
        return fused_moe_native(x, w13, w2, topk_weights, topk_ids, activation=activation)
    # fp32 only under the interpreter: on a GPU an IEEE-fp32 grouped GEMM is slow to compile and to run
    supported = ((x.dtype in _FLOATS[:2] or interpreting()) and w13.dtype == x.dtype and w2.dtype == x.dtype
                 and topk_weights.dtype in _FLOATS)
    if not use_triton(x, w13, w2, topk_weights, topk_ids, supported=supported) or x.shape[0] == 0:
        return fused_moe_native(x, w13, w2, topk_weights, topk_ids)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights)):
        return FusedMoEFunction.apply(x, w13, w2, topk_weights, topk_ids)
    return _forward(x, w13, w2, topk_weights, topk_ids, save=False)[0]
