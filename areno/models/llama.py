"""Llama (1 to 3.x): pre-norm decoder, GQA, optional attention/MLP biases, Llama 3 RoPE scaling (in the tables)."""

from __future__ import annotations

from areno.models.base import CausalLM
from areno.models.model_config import ModelConfig, dense_config
from areno.models.registry import ModelCard, register


def llama_config(hf) -> ModelConfig:
    return dense_config(hf, "llama")


class LlamaForCausalLM(CausalLM):
    pass


register("llama", llama_config, LlamaForCausalLM,
         card=ModelCard("Llama 1 to 3.x", notes="Llama 3 RoPE scaling"))
