"""GPT-OSS's layers: attention with per-head sinks, and the MoE with biases and the clamped SwiGLU.

Attention: Llama GQA with q/k/v/o biases and a learned logit per query head (``sinks``, Hub ``self_attn.sinks``) that
joins every query's softmax denominator and adds no value. ``GptOssAttention.attend`` is the one place the sinks reach
the attention kernels (``attention`` / ``paged_attention`` ``sinks=``, Triton on CUDA, native elsewhere).

MoE (every layer): router ``logits = x W^T + b``, the top-k logits, softmax over those k (= the top-k softmax
probabilities renormalised, so Qwen3-MoE's router with ``renormalize=True`` computes it); each expert
``gate_up = x Wgu + bgu`` (Hub layout ``gate_up_proj [E, H, 2I]`` with gate and up INTERLEAVED in the columns:
gate = ``[..., ::2]``, up = ``[..., 1::2]``), ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
``h = (up + 1) * gate * sigmoid(alpha * gate)``, ``y = h Wd + bd`` (``down_proj [E, I, H]``); output
``sum_k w_k y_k``. The expert weights keep the Hub layout (the loader copies slices, it does not transpose); the experts
run on ``kernels/moe/biased.py`` (areno's grouped GEMMs with the bias and activation between them). Under TP each rank
holds every expert's slice of the intermediate dim (an even slice of the interleaved columns keeps gate/up pairs
together); the down bias is applied after the all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from areno.kernels.moe.biased import biased_moe
from areno.models.base import Attention
from areno.models.layers import Linear
from areno.models.model_config import ModelConfig
from areno.models.qwen3_moe import SparseMoE
from areno.models.tp import copy_to_tp, layout, reduce_from_tp


class Sinks(nn.Module):
    """The attention sinks ``[Hq]`` (its own module so the TP plan splits them with the query heads)."""

    tp_style: str | None = None
    tp_group = None

    def __init__(self, num_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads))


class GptOssAttention(Attention):
    def __init__(self, cfg: ModelConfig, attn_backend: str = "flash"):
        super().__init__(cfg, attn_backend)
        self.sink = Sinks(cfg.num_heads)

    def attend(self, q, k, v, meta, kv_cache=None):
        # ---- THE place GPT-OSS's sinks reach the attention kernels (packed and paged) ----------------------------
        return super().attend(q, k, v, meta, kv_cache, sinks=self.sink.weight)

    def layouts(self, name: str, hf: str, cfg: ModelConfig) -> dict:
        out = super().layouts(name, hf, cfg)
        out[f"{name}.sink.weight"] = [layout((cfg.num_heads,), 0, [(f"{hf}.sinks", cfg.num_heads)])]
        return out


class GptOssExperts(nn.Module):
    """The experts in the Hub layout (``gate_up_proj [E, H, 2I]`` interleaved, ``down_proj [E, I, H]``)."""

    tp_style: str | None = None
    tp_group = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))


class GptOssMoE(SparseMoE):
    """Qwen3-MoE's routing (renormalised top-k softmax == softmax over the top-k logits; replay, load counters) with
    a biased router and GPT-OSS's experts."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.renormalize = e, cfg.num_experts_per_tok, True
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate = Linear(h, e, bias=True)  # the router (Hub ``mlp.router``), replicated under TP
        self.experts = GptOssExperts(e, h, i)
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))  # replicated: added after the TP all-reduce
        self.register_buffer("expert_load", None, persistent=False)

    def compute(self, x, weights, ids):
        ex = self.experts
        group = ex.tp_group
        xs, ws = copy_to_tp(x, group), copy_to_tp(weights, group)
        out = biased_moe(xs, ex.gate_up_proj, ex.gate_up_proj_bias, ex.down_proj, ws, ids, self.alpha, self.limit)
        out = reduce_from_tp(out, group)
        # sum_j w_j * bd[e_j] as (the dense [T, E] routing weights) @ bd: no [T, k, H] temporary
        dense = weights.new_zeros(weights.shape[0], self.num_experts).scatter_add(1, ids.long(), weights)
        return out + (dense @ self.down_proj_bias.float()).to(out.dtype)

    def layouts(self, name: str, hf: str, cfg: ModelConfig) -> dict:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        exp = f"{hf}.experts"
        return {
            f"{name}.gate.weight": [layout((e, h), 0, [(f"{hf}.router.weight", e)])],
            f"{name}.gate.bias": [layout((e,), 0, [(f"{hf}.router.bias", e)])],
            f"{name}.experts.gate_up_proj": [layout((e, h, 2 * i), 2, [(f"{exp}.gate_up_proj", 2 * i)])],
            f"{name}.experts.gate_up_proj_bias": [layout((e, 2 * i), 1, [(f"{exp}.gate_up_proj_bias", 2 * i)])],
            f"{name}.experts.down_proj": [layout((e, i, h), 1, [(f"{exp}.down_proj", i)])],
            f"{name}.down_proj_bias": [layout((e, h), 0, [(f"{exp}.down_proj_bias", e)])],
        }
