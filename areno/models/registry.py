"""Adapters by Hugging Face ``model_type``: how to read the config and which model class to build.

Each adapter module calls ``register`` at import with what it supports (``ModelCard``); ``get_adapter`` imports the
built-in ones on first use. ``areno check --models`` prints the supported-models table generated from the cards;
the README's table is that output (a test compares them), so it cannot drift from the code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

BUILTIN = ("qwen3", "qwen3_moe", "llama", "bailing_hybrid", "qwen3_vl", "olmo2", "olmo3", "gpt_oss", "deepseek_v3",
           "kimi_linear", "qwen3_5", "gemma4")


@dataclass(frozen=True)
class ModelCard:
    """What a family's adapter supports, for the supported-models table."""

    family: str  # the name users know ("Qwen3-MoE")
    kinds: tuple[str, ...] = ("dense",)  # any of: dense, moe, hybrid (linear attention layers), vision
    tp: str = "yes"  # "yes", "no", or the condition ("must divide the KV heads")
    routing_replay: bool = False  # --routing-replay records and replays the router's choices
    mtp_kept: bool | None = None  # multi-token-prediction layers kept and saved untouched; None: the family has none
    notes: str = ""


@dataclass(frozen=True)
class Adapter:
    model_type: str
    config_from_hf: Callable  # transformers config (or dict) -> ModelConfig
    model_class: type  # model_class(ModelConfig, attn_backend=...) built on any device (meta at load)
    check_config: Callable | None = None  # raw config.json dict -> None, or ValueError (before transformers reads it)
    card: ModelCard = field(default_factory=lambda: ModelCard("?"))


MODEL_REGISTRY: dict[str, Adapter] = {}


def register(model_type: str, config_from_hf: Callable, model_class: type, check_config: Callable | None = None,
             *, card: ModelCard) -> None:
    MODEL_REGISTRY[model_type] = Adapter(model_type, config_from_hf, model_class, check_config, card)


def load_builtin() -> dict[str, Adapter]:
    for name in BUILTIN:
        importlib.import_module(f"areno.models.{name}")
    return MODEL_REGISTRY


def get_adapter(model_type: str) -> Adapter:
    load_builtin()
    if model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"model_type {model_type!r} is not supported by areno's adapters; supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[model_type]


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def supported_models_table() -> str:
    """The supported-models table (markdown), one row per registered family (model types of one family joined)."""
    rows: dict[ModelCard, list[str]] = {}
    adapters = load_builtin()
    order = {t: i for i, t in enumerate(BUILTIN)}  # BUILTIN's order, whatever order the modules were imported in
    for model_type in sorted(adapters, key=lambda t: (order.get(t, len(order)), t)):
        adapter = adapters[model_type]
        rows.setdefault(adapter.card, []).append(f"`{model_type}`")
    lines = ["| family | Hugging Face `model_type` | kind | TP | routing replay | MTP layers kept | notes |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for card, types in rows.items():
        routing = _yes(card.routing_replay) if "moe" in card.kinds else "-"
        lines.append(f"| {card.family} | {', '.join(types)} | {', '.join(card.kinds)} | {card.tp} | {routing} | "
                     f"{_yes(card.mtp_kept)} | {card.notes} |")
    return "\n".join(lines) + "\n"
