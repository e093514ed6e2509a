"""Routed experts with biases and GPT-OSS's clamped SwiGLU, on the grouped GEMMs of ``gemm.py``.

    gu = x[t] Wgu[e] + bgu[e]                      Wgu [E, H, 2I] (x @ W, the Hub layout), gate/up INTERLEAVED
    h  = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),   g = min(gate, limit),  gate = gu[::2], up = gu[1::2]
    y[t] = sum_j w[t, j] * (h Wd[e] )              Wd [E, I, H]; the down bias ``sum_j w_j bd[e_j]`` is the caller's

Triton path: the two GEMMs run on ``expert_rows`` over (token, slot) pairs sorted by expert (no host sync, no
padding), each a small autograd Function whose backward is two more grouped GEMMs (``expert_rows`` with the expert
weight's transposed strides for the input gradient, ``expert_weight_grad`` for the weight gradient); the bias, the
activation and the routing-weight sum are plain PyTorch between them (autograd). Native path: the per-expert loop
(host syncs on the hit experts) with gradients or at training size, else every expert over every token masked (fixed
shapes, graph-capturable); ``biased_moe_reference`` is the dense float64-capable oracle for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areno.kernels.dispatch import interpreting, use_triton
from areno.kernels.moe import gemm as moe_gemm
from areno.kernels.moe.fused import DENSE_PAIRS_PER_EXPERT, sort_by_expert

__all__ = ["biased_moe", "biased_moe_native", "biased_moe_reference", "clamped_swiglu"]


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``; gate/up interleaved."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def biased_moe_reference(x, gate_up, gate_up_bias, down, weights, ids, alpha: float, limit: float):
    """Dense oracle in the inputs' dtype (pass float64): gathers each slot's expert weights."""
    e = ids.long()
    h = clamped_swiglu(torch.einsum("th,tkhi->tki", x, gate_up[e]) + gate_up_bias[e], alpha, limit)
    return (torch.einsum("tki,tkih->tkh", h, down[e]) * weights[..., None].to(h.dtype)).sum(1)


def biased_moe_native(x, gate_up, gate_up_bias, down, weights, ids, alpha: float, limit: float):
    """The per-expert loop (host syncs), or without gradients at decode size every expert masked (no syncs)."""
    E = gate_up.shape[0]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate_up, gate_up_bias, down, weights))
    out = torch.zeros_like(x)
    if not grad and ids.numel() <= DENSE_PAIRS_PER_EXPERT * E:
        for e in range(E):
            hit = ids == e
            y = clamped_swiglu(x @ gate_up[e] + gate_up_bias[e], alpha, limit) @ down[e]
            y = y * (weights * hit).sum(dim=1, keepdim=True).to(y.dtype)
            out += torch.where(hit.any(dim=1, keepdim=True), y, 0).to(out.dtype)  # never 0 * inf
        return out
    mask = F.one_hot(ids.long(), num_classes=E).permute(2, 1, 0)  # [E, k, T]
    for e in (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
        slot, tok = torch.where(mask[e])
        y = clamped_swiglu(x[tok] @ gate_up[e] + gate_up_bias[e], alpha, limit) @ down[e]
        out = out.index_add(0, tok, (y * weights[tok, slot, None].to(y.dtype)).to(out.dtype))
    return out


def operand_strides(w, transposed: bool) -> tuple:
    """(expert, k, n) strides of ``w[e]`` as the GEMM's [K, N] operand (``transposed``: of ``w[e]^T``)."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transposed else (w.stride(0), w.stride(1), w.stride(2))


class GatherGEMM(torch.autograd.Function):
    """``out[r] = x[tok(r)] @ W[e(r)]`` by sorted row r (``W [E, K, N]``)."""

    @staticmethod
    def forward(ctx, x, w, order, counts, top_k):
        ctx.save_for_backward(x, w, order, counts)
        ctx.top_k = top_k
        return moe_gemm.expert_rows(x, w, operand_strides(w, False), w.shape[2], order, counts, top_k, gather_a=True,
                                    out_sorted=True)

    @staticmethod
    def backward(ctx, dout):
        x, w, order, counts = ctx.saved_tensors
        dout, k = dout.contiguous(), ctx.top_k
        dx = dw = None
        if ctx.needs_input_grad[0]:  # by pair, then each token's k slots summed
            dx = moe_gemm.expert_rows(dout, w, operand_strides(w, True), w.shape[1], order, counts, k)
            dx = dx.view(x.shape[0], k, -1).sum(1)
        if ctx.needs_input_grad[1]:
            dw = moe_gemm.expert_weight_grad(x, dout, order, counts, k, gather_a=True, gather_b=False)
        return dx, dw, None, None, None


class ScatterGEMM(torch.autograd.Function):
    """``out[pair(r)] = a[r] @ W[e(r)]`` (``a`` by sorted row, ``out`` by pair, or by sorted row with
    ``out_sorted``; ``W [E, K, N]``)."""

    @staticmethod
    def forward(ctx, a, w, order, counts, top_k, out_sorted=False):
        ctx.save_for_backward(a, w, order, counts)
        ctx.top_k, ctx.out_sorted = top_k, out_sorted
        return moe_gemm.expert_rows(a, w, operand_strides(w, False), w.shape[2], order, counts, top_k,
                                    out_sorted=out_sorted)

    @staticmethod
    def backward(ctx, dout):
        a, w, order, counts = ctx.saved_tensors
        dout_sorted = (dout if ctx.out_sorted else dout[order.long()]).contiguous()
        da = dw = None
        if ctx.needs_input_grad[0]:
            da = moe_gemm.expert_rows(dout_sorted, w, operand_strides(w, True), w.shape[1], order, counts, ctx.top_k,
                                      out_sorted=True)
        if ctx.needs_input_grad[1]:
            dw = moe_gemm.expert_weight_grad(a, dout_sorted, order, counts, ctx.top_k, gather_a=False,
                                             gather_b=False)
        return da, dw, None, None, None, None


def _biased_moe_triton(x, gate_up, gate_up_bias, down, weights, ids, alpha, limit):
    T, k = ids.shape
    order, counts = sort_by_expert(ids, gate_up.shape[0])
    expert = ids.reshape(-1)[order.long()].long()  # each sorted row's expert
    gu = GatherGEMM.apply(x, gate_up, order, counts, k) + gate_up_bias[expert]
    h = clamped_swiglu(gu, alpha, limit).contiguous()
    y = ScatterGEMM.apply(h, down, order, counts, k).view(T, k, -1)
    return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)


def biased_moe(x, gate_up, gate_up_bias, down, weights, ids, alpha: float, limit: float) -> torch.Tensor:
    """Routed biased experts (module docstring) ``[T, H]``; differentiable in x, the weights, biases and routing
    weights. ``ids`` int ``[T, k]`` must lie in ``[0, E)`` (not checked on device)."""
    E, H, I2 = gate_up.shape
    assert x.dim() == 2 and x.shape[1] == H and I2 % 2 == 0, f"biased_moe: x [T, {H}] and gate_up [E, H, 2I] needed"
    assert down.shape == (E, I2 // 2, H) and gate_up_bias.shape == (E, I2), "biased_moe: down [E, I, H], bias [E, 2I]"
    assert ids.shape == weights.shape and ids.shape[0] == x.shape[0] and not ids.is_floating_point()
    same = gate_up.dtype == down.dtype == x.dtype
    supported = same and (x.dtype in (torch.float16, torch.bfloat16) or interpreting())
    if x.shape[0] == 0 or not use_triton(x, gate_up, down, supported=supported):
        return biased_moe_native(x, gate_up, gate_up_bias, down, weights, ids, alpha, limit)
    return _biased_moe_triton(x.contiguous(), gate_up, gate_up_bias, down, weights, ids, alpha, limit)
