"""Routed experts with per-expert LoRA on their two GEMMs (PEFT's ``target_parameters`` adapters of transformers'
fused ``experts.gate_up_proj`` / ``experts.down_proj``), applied unmerged:

    gu = x W13_e^T + (x A_e^T) B_e^T * s,   h = act(gate) * up,   y = sum_j w_j * (h W2_e^T + (h A'_e^T) B'_e^T * s)

with PEFT's stacked factors ``(A [E*r, in], B [out, r*E], s)``: expert e's A is rows ``e*r : (e+1)*r`` of A, its B
columns ``e::E`` of B (rank-major), ``s = alpha / r``.

Triton path: the (token, slot) pairs sorted by expert once (``sort_by_expert``), then every GEMM on the grouped
``expert_rows`` kernel (gemm.py): the base gate_up gathers the tokens, the thin ``x A_e^T`` too (N = r), ``B_e`` maps
sorted rows to sorted rows (K = r), the base down and the thin ``h A'_e^T`` / ``B'_e`` write pair order; the
activation and the routing-weight sum are plain PyTorch between them; each GEMM an autograd Function whose backward
is two more grouped GEMMs (frozen base weights get none). The factors run in the input's dtype (PEFT casts its delta
to the weight's dtype too). No host sync: CUDA graphs capture it. Native path: the per-expert loop (host syncs), or
without gradients at decode size or under graph capture every expert over every token masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areno.kernels.dispatch import interpreting, use_triton
from areno.kernels.moe.biased import GatherGEMM, ScatterGEMM
from areno.kernels.moe.fused import ACTIVATIONS, DENSE_PAIRS_PER_EXPERT, check_activation, check_inputs, sort_by_expert

__all__ = ["fused_moe_lora", "fused_moe_lora_native"]


def _operands(factors, E: int, dtype):
    """PEFT's ``(A [E*r, in], B [out, r*E], s)`` as grouped-GEMM operands ``A^T [E, in, r]``, ``B^T [E, r, out]``."""
    a, b, scaling = factors
    r = a.shape[0] // E
    a_t = a.to(dtype).view(E, r, a.shape[1]).transpose(1, 2)
    b_t = b.to(dtype).view(b.shape[0], r, E).permute(2, 1, 0)
    return a_t, b_t, scaling


def _fused_moe_lora_triton(x, w13, w2, weights, ids, gate_up, down, activation):
    T, k = ids.shape
    E = w13.shape[0]
    order, counts = sort_by_expert(ids, E)
    gu = GatherGEMM.apply(x, w13.transpose(1, 2), order, counts, k)  # sorted rows [M, 2I]
    if gate_up is not None:
        a_t, b_t, s = _operands(gate_up, E, x.dtype)
        gu = gu + ScatterGEMM.apply(GatherGEMM.apply(x, a_t, order, counts, k), b_t, order, counts, k, True) * s
    gate, up = gu.chunk(2, dim=-1)
    h = (ACTIVATIONS[activation](gate) * up).contiguous()
    y = ScatterGEMM.apply(h, w2.transpose(1, 2), order, counts, k)  # pair order [T*k, H]
    if down is not None:
        a_t, b_t, s = _operands(down, E, x.dtype)
        y = y + ScatterGEMM.apply(ScatterGEMM.apply(h, a_t, order, counts, k, True), b_t, order, counts, k) * s
    return (y.view(T, k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(1).to(x.dtype)


def fused_moe_lora_native(x, w13, w2, topk_weights, topk_ids, gate_up=None, down=None, *, activation: str = "silu"):
    """The per-expert loop with gradients or at training size, else (and always while a CUDA graph captures) every
    expert over every token masked (no host sync)."""
    E, act = w13.shape[0], ACTIVATIONS[activation]
    tensors = (x, w13, w2, topk_weights, *(gate_up or ())[:2], *(down or ())[:2])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()  # a CUDA graph: never a host sync
    dense = not grad and (capturing or topk_ids.numel() <= DENSE_PAIRS_PER_EXPERT * E)

    def delta(h, factors, e):
        if factors is None:
            return 0
        a, b, scaling = factors
        r = a.shape[0] // E
        d = (h.to(a.dtype) @ a[e * r : (e + 1) * r].t()) @ b[:, e::E].t()
        return (d * scaling).to(h.dtype)

    def expert(h, e):
        gate, up = (F.linear(h, w13[e]) + delta(h, gate_up, e)).chunk(2, dim=-1)
        g = act(gate) * up
        return F.linear(g, w2[e]) + delta(g, down, e)

    out = torch.zeros_like(x)
    if dense:
        for e in range(E):
            hit = topk_ids == e  # [T, k]
            o = expert(x, e) * (topk_weights * hit).sum(dim=1, keepdim=True)
            out += torch.where(hit.any(dim=1, keepdim=True), o, 0).to(out.dtype)
        return out
    mask = F.one_hot(topk_ids.long(), num_classes=E).permute(2, 1, 0)  # [E, k, T]
    for e in (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
        slot, tok = torch.where(mask[e])
        o = expert(x[tok], e) * topk_weights[tok, slot, None]
        out = out.index_add(0, tok, o.to(out.dtype))
    return out


def fused_moe_lora(x, w13, w2, topk_weights, topk_ids, gate_up=None, down=None, *, activation: str = "silu"):
    """Routed experts with per-expert LoRA (module docstring) ``[T, H]``; ``gate_up``/``down``: None or PEFT's
    ``(A, B, scaling)``. Gradients reach x, the routing weights and the factors (and base weights that require
    them). Ids must lie in ``[0, E)`` (not checked on device)."""
    check_activation(activation)
    check_inputs(x, w13, w2, topk_weights, topk_ids)
    supported = (x.dtype in (torch.float16, torch.bfloat16) or interpreting()) and w13.dtype == w2.dtype == x.dtype
    if x.shape[0] == 0 or not use_triton(x, w13, w2, supported=supported):
        return fused_moe_lora_native(x, w13, w2, topk_weights, topk_ids, gate_up, down, activation=activation)
    return _fused_moe_lora_triton(x.contiguous(), w13, w2, topk_weights, topk_ids, gate_up, down, activation)
