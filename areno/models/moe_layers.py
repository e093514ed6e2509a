"""The sigmoid-routed MoE block of the DeepSeek-style adapters (Ling 3, DeepSeek-V3, Kimi-Linear).

sigmoid scores ``s = sigmoid(x W_r^T)`` (fp32), a per-expert fp32 selection bias that steers the group-limited top-k
choice only (groups ranked by the sum of their top-2 biased scores, ``topk_group`` of ``n_group`` kept), weights
``s`` of the chosen experts, renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``; routed experts
on ``fused_moe`` plus the always-on shared expert(s). ``SigmoidMoELM`` gives the model its load counters and the
auxiliary-loss-free bias update (``update_routing_bias``). Routing replay and ``expert_load`` as in ``qwen3_moe``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from areno.kernels.moe.routing import route_sigmoid_grouped_topk
from areno.models.base import MLP
from areno.models.qwen3_moe import Experts, replay_routes
from areno.models.tp import copy_to_tp, layout, one_layout, reduce_from_tp


class Router(nn.Module):
    """``weight [E, H]`` (scores = sigmoid(x W^T) in fp32) and the selection-only ``expert_bias [E]``, both fp32,
    replicated under TP. The bias is not trained by the optimizer: ``update_routing_bias`` moves it."""

    fp32_params = ("weight", "expert_bias")

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.expert_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)


class SigmoidMoE(nn.Module):
    """Routed experts (``fused_moe``) plus the shared expert; routing counts ``expert_load`` (see qwen3_moe).
    ``cfg`` is an ``MLAConfig`` (its routing fields and Hub names)."""

    has_router = True

    def __init__(self, cfg):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.register_buffer("expert_load", None, persistent=False)

    def init_buffers(self, device) -> None:
        self.expert_load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)

    def route(self, x, given=None):
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids, counts = route_sigmoid_grouped_topk(
            logits, self.top_k, bias=self.gate.expert_bias, n_group=self.n_group, topk_group=self.topk_group,
            routed_scaling_factor=self.scaling, renormalize=self.renormalize,
        )  # fmt: skip
        if given is not None:  # routing replay: the given experts, weighted by the current router
            ids, counts = replay_routes(ids, given, self.num_experts)
        if given is not None or (torch.is_grad_enabled() and logits.requires_grad):
            # the kernel's weights carry no autograd graph: recompute them from the chosen ids (T x k, cheap)
            weights = torch.sigmoid(logits).gather(1, ids.long())
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * self.scaling
        if self.training and torch.is_grad_enabled() and self.expert_load is not None:
            self.expert_load += counts
        return weights, ids

    def compute(self, x, weights, ids):
        group = self.experts.tp_group
        xs, weights = copy_to_tp(x, group), copy_to_tp(weights, group)
        routed = reduce_from_tp(self.experts.routed(xs, weights, ids), group)
        return routed + self.shared_experts(x)

    def forward(self, x):
        return self.compute(x, *self.route(x))

    def layouts(self, name: str, hf: str, cfg) -> dict:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        exp, (gate, up, down) = f"{hf}.experts", cfg.hf_expert_names
        out = {
            f"{name}.gate.weight": one_layout(f"{hf}.gate.weight", e, h),
            f"{name}.gate.expert_bias": one_layout(f"{hf}.gate.{cfg.hf_router_bias}", e),
            f"{name}.experts.w13": [
                layout((e, 2 * i, h), 0, [(f"{exp}.{j}.{gate}.weight", i), (f"{exp}.{j}.{up}.weight", i)], j)
                for j in range(e)
            ],
            f"{name}.experts.w2": [layout((e, h, i), 1, [(f"{exp}.{j}.{down}.weight", i)], j) for j in range(e)],
        }
        out.update(self.shared_experts.layouts(f"{name}.shared_experts", f"{hf}.shared_experts", cfg))
        return out


class SigmoidMoELM:
    """Mixin for a ``CausalLM`` with ``SigmoidMoE`` layers: load counters and the selection-bias update."""

    has_routing_bias = True  # the sigmoid routers' selection bias (update_routing_bias)

    def moe_layers(self) -> list[SigmoidMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SigmoidMoE)]

    def expert_load(self) -> torch.Tensor:
        """int64 ``[num_moe_layers, E]``: (token, slot) pairs routed to each expert by training forwards."""
        return torch.stack([m.expert_load for m in self.moe_layers()])

    def reset_expert_load(self) -> None:
        for m in self.moe_layers():
            m.expert_load.zero_()

    @torch.no_grad()
    def update_routing_bias(self, rate: float, dp_group=None) -> None:
        """One sign-based step of the selection bias (auxiliary-loss-free balancing), then counters reset:
        ``bias_e += rate * sign(mean_e' load_e' - load_e)`` per MoE layer, loads summed over data-parallel ranks
        (TP ranks route identically, so their counts already agree). ``rate == 0`` only resets the counters."""
        layers = self.moe_layers()
        if not layers:
            return
        if rate:
            load = self.expert_load().float()
            if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
                dist.all_reduce(load, group=dp_group)
            step = rate * torch.sign(load.mean(dim=-1, keepdim=True) - load)
            for m, s in zip(layers, step):
                m.gate.expert_bias.add_(s.to(m.gate.expert_bias.dtype))
        self.reset_expert_load()
