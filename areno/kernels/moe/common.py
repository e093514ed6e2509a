"""What every routed-experts path shares: the experts' gate activations, the argument checks and the expert sort."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areno.kernels.moe.routing import expert_counts

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}  # the experts' gate activation


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order int32 [T*k]: pair ids t*k + j sorted stably by expert, counts int32 [E]); no host sync."""
    ids = topk_ids.reshape(-1)
    order = torch.argsort(ids, stable=True).to(torch.int32)
    return order, expert_counts(ids, num_experts)


def check_activation(activation: str):
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")


def check_inputs(x, w13, w2, topk_weights, topk_ids):
    assert x.dim() == 2, f"fused_moe: x must be [T, H], got {tuple(x.shape)}"
    T, H = x.shape
    assert w13.dim() == 3 and w13.shape[2] == H and w13.shape[1] % 2 == 0, \
        f"fused_moe: w13 must be [E, 2I, H={H}], got {tuple(w13.shape)}"
    E, I = w13.shape[0], w13.shape[1] // 2
    assert w2.shape == (E, H, I), f"fused_moe: w2 must be [E={E}, H={H}, I={I}], got {tuple(w2.shape)}"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == T, f"fused_moe: topk_ids must be [T={T}, k]"
    assert not topk_ids.is_floating_point(), f"fused_moe: topk_ids must be integer, got {topk_ids.dtype}"
    assert topk_weights.shape == topk_ids.shape, \
        f"fused_moe: topk_weights {tuple(topk_weights.shape)} vs topk_ids {tuple(topk_ids.shape)}"
