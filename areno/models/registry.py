"""Adapters by Hugging Face ``model_type``: how to read the config and which model class to build.

Each adapter module calls ``register`` at import; ``get_adapter`` imports the built-in ones on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

BUILTIN = ("qwen3", "qwen3_moe", "llama", "bailing_hybrid", "qwen3_vl", "olmo2", "olmo3")


@dataclass(frozen=True)
class Adapter:
    model_type: str
    config_from_hf: Callable  # transformers config (or dict) -> ModelConfig
    model_class: type  # model_class(ModelConfig, attn_backend=...) built on any device (meta at load)
    check_config: Callable | None = None  # raw config.json dict -> None, or ValueError (before transformers reads it)


MODEL_REGISTRY: dict[str, Adapter] = {}


def register(model_type: str, config_from_hf: Callable, model_class: type, check_config: Callable | None = None
             ) -> None:
    MODEL_REGISTRY[model_type] = Adapter(model_type, config_from_hf, model_class, check_config)


def get_adapter(model_type: str) -> Adapter:
    for name in BUILTIN:
        importlib.import_module(f"areno.models.{name}")
    if model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"model_type {model_type!r} is not supported by areno's adapters; supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[model_type]
