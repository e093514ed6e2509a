"""Qwen3 (dense): Llama layout with GQA and a per-head RMSNorm on queries and keys before RoPE."""

from __future__ import annotations

from areno.models.base import CausalLM
from areno.models.model_config import ModelConfig, dense_config, get
from areno.models.registry import ModelCard, register


def qwen3_config(hf) -> ModelConfig:
    if get(hf, "use_sliding_window", False):
        raise NotImplementedError("qwen3: use_sliding_window=true is not supported")
    return dense_config(hf, "qwen3", qk_norm=True)


class Qwen3ForCausalLM(CausalLM):
    pass


register("qwen3", qwen3_config, Qwen3ForCausalLM,
         card=ModelCard("Qwen3", notes="per-head QK norm, GQA"))
