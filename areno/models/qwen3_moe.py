"""Qwen3-MoE: the Qwen3 decoder with sparse MoE MLPs (softmax top-k router, SwiGLU experts, no shared expert).

Hugging Face stores one ``gate_proj/up_proj/down_proj`` per expert; areno stacks them at load into
``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` for ``fused_moe``, and unstacks them at save.
Each MoE layer counts the tokens routed to each expert in ``expert_load`` (int64 ``[E]``, not saved) on every
forward that trains (``model.training`` and grad enabled); routing runs outside activation recomputation, so a
step counts each token exactly once. ``model.expert_load()`` stacks them ``[num_moe_layers, E]``.

Routing replay: ``route(x, given)`` uses the expert ids ``given [T, k]`` (the rollout's choice; a row of -1 chooses
as usual) and computes their weights from the current router logits, so training runs the experts the rollout ran.
"""

from __future__ import annotations

import torch
from torch import nn

from areno.kernels.moe.fused import fused_moe
from areno.kernels.moe.lora import fused_moe_lora
from areno.kernels.moe.routing import expert_counts, route_softmax_topk
from areno.models.base import MLP, CausalLM
from areno.models.layers import Linear, held_fp8, hold_fp8_
from areno.models.model_config import ModelConfig, dense_config, get
from areno.models.registry import ModelCard, register
from areno.models.tp import copy_to_tp, layout, reduce_from_tp


def qwen3_moe_config(hf) -> ModelConfig:
    if get(hf, "use_sliding_window", False):
        raise NotImplementedError("qwen3_moe: use_sliding_window=true is not supported")
    return dense_config(
        hf,
        "qwen3_moe",
        qk_norm=True,
        num_experts=get(hf, "num_experts", None) or get(hf, "num_local_experts"),
        num_experts_per_tok=get(hf, "num_experts_per_tok"),
        moe_intermediate_size=get(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(get(hf, "norm_topk_prob", False)),
        decoder_sparse_step=get(hf, "decoder_sparse_step", 1),
        mlp_only_layers=list(get(hf, "mlp_only_layers", [])),
    )


def replay_routes(ids, given, num_experts: int):
    """``ids [T, k]`` with the rows of ``given`` that hold ids (>= 0) put in their place, and the per-expert counts
    of the result (int32 ``[E]``, sync-free)."""
    ids = torch.where(given[:, :1] >= 0, given.to(ids.dtype), ids)
    return ids, expert_counts(ids, num_experts)


class Experts(nn.Module):
    """Stacked expert weights; under TP every rank holds every expert's slice of the intermediate dim. ``lora``
    (models/lora_experts.py, not a submodule) adds a LoRA adapter's per-expert pairs while its adapter is on.
    ``set_fp8_()`` (FP8 rollout, models/fp8_rollout.py) holds blockwise E4M3 copies of both stacks beside them;
    while ``fp8_on`` the experts run on those (``fused_moe``'s FP8 path), otherwise on the weights."""

    tp_style: str | None = None
    tp_group = None
    lora = None
    fp8_params = ("w13", "w2")  # what FP8 rollout quantises
    fp8_on: bool = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def routed(self, x, weights, ids, activation: str = "silu"):
        """The routed experts' output ``[T, H]`` (``fused_moe``; with an active LoRA, ``fused_moe_lora``)."""
        factors = self.lora.factors() if self.lora is not None else None
        if factors is not None:
            return fused_moe_lora(x, self.w13, self.w2, weights, ids, *factors, activation=activation)
        if self.fp8_on:
            return fused_moe(x, held_fp8(self, "w13"), held_fp8(self, "w2"), weights, ids, activation=activation)
        return fused_moe(x, self.w13, self.w2, weights, ids, activation=activation)

    def set_fp8_(self) -> None:
        """(Re)make the FP8 copies of ``w13`` and ``w2`` from the weights (in place after the first time); under TP
        of this rank's intermediate slice."""
        for param in self.fp8_params:
            hold_fp8_(self, param)


class SparseMoE(nn.Module):
    has_router = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)  # the router, replicated under TP
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.register_buffer("expert_load", None, persistent=False)

    def init_buffers(self, device) -> None:
        self.expert_load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)

    def route(self, x, given=None):
        logits = self.gate(x)
        weights, ids, counts = route_softmax_topk(logits, self.top_k, renormalize=self.renormalize)
        if given is not None:
            ids, counts = replay_routes(ids, given, self.num_experts)
        if given is not None or (torch.is_grad_enabled() and logits.requires_grad):
            # the routing kernel's weights carry no autograd graph: recompute them from the chosen ids (T x E, cheap)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids.long())
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.training and torch.is_grad_enabled() and self.expert_load is not None:
            self.expert_load += counts
        return weights, ids

    def compute(self, x, weights, ids):
        group = self.experts.tp_group
        x, weights = copy_to_tp(x, group), copy_to_tp(weights, group)
        out = self.experts.routed(x, weights, ids)
        return reduce_from_tp(out, group)

    def forward(self, x):
        return self.compute(x, *self.route(x))

    def layouts(self, name: str, hf: str, cfg: ModelConfig) -> dict:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        exp = f"{hf}.experts"
        return {
            f"{name}.gate.weight": [layout((e, h), 0, [(f"{hf}.gate.weight", e)])],
            f"{name}.experts.w13": [
                layout((e, 2 * i, h), 0, [(f"{exp}.{j}.gate_proj.weight", i), (f"{exp}.{j}.up_proj.weight", i)], j)
                for j in range(e)
            ],
            f"{name}.experts.w2": [layout((e, h, i), 1, [(f"{exp}.{j}.down_proj.weight", i)], j) for j in range(e)],
        }


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, *, attn_backend: str = "flash"):
        factory = lambda cfg, i: SparseMoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg)  # noqa: E731
        super().__init__(cfg, attn_backend=attn_backend, mlp_factory=factory)

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def expert_load(self) -> torch.Tensor:
        """int64 ``[num_moe_layers, E]``: tokens routed to each expert since the last reset (training forwards)."""
        return torch.stack([m.expert_load for m in self.moe_layers()])

    def reset_expert_load(self) -> None:
        for m in self.moe_layers():
            m.expert_load.zero_()


register("qwen3_moe", qwen3_moe_config, Qwen3MoeForCausalLM,
         card=ModelCard("Qwen3-MoE", ("moe",), routing_replay=True, notes="routed experts on areno's grouped GEMMs"))
