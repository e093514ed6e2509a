"""OLMo 3: OLMo 2's post-norm, full-projection QK-norm decoder with sliding-window attention on some layers.

``config.layer_types`` names each layer ``sliding_attention`` (its queries see the last ``sliding_window`` keys,
their own included, as transformers' mask) or ``full_attention``. The window runs on the native attention paths for
now (the Triton kernels refuse it; NOTES-olmo3.md). transformers gives each layer type its own RoPE; a checkpoint
whose two types differ in RoPE is refused at load in one line, as is an unknown layer type.
"""

from __future__ import annotations

from areno.models.model_config import ModelConfig, get
from areno.models.olmo2 import Olmo2Attention, Olmo2ForCausalLM, olmo2_config
from areno.models.registry import register

LAYER_TYPES = ("sliding_attention", "full_attention")


def _flat_rope(hf, layer_types: list[str]) -> dict:
    """The one RoPE setting both layer types share (transformers 5 keys ``rope_parameters`` by layer type)."""
    params = get(hf, "rope_parameters", None) or {}
    if not any(t in params for t in LAYER_TYPES):
        return dict(params)
    per_type = {t: dict(params.get(t) or {}) for t in sorted(set(layer_types))}
    first = next(iter(per_type.values()))
    if any(p != first for p in per_type.values()):
        raise NotImplementedError(f"olmo3: rope_parameters differ between layer types ({per_type}); "
                                  "a RoPE per layer type is not supported yet")
    return first


def olmo3_config(hf) -> ModelConfig:
    raw = dict(hf) if isinstance(hf, dict) else hf.to_dict()
    n = get(raw, "num_hidden_layers")
    layer_types = list(get(raw, "layer_types", None) or
                      ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)])
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad or len(layer_types) != n:
        raise NotImplementedError(f"olmo3: layer_types must list {n} of {LAYER_TYPES}, got {layer_types}")
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    window = get(raw, "sliding_window", None)
    if sliding and (not isinstance(window, int) or window < 1):
        raise NotImplementedError(f"olmo3: sliding_window={window!r} must be a positive int for the sliding layers")
    flat = {**raw, "rope_parameters": _flat_rope(raw, layer_types)}
    cfg = olmo2_config(flat)
    cfg.model_type, cfg.sliding_window, cfg.sliding_layers = "olmo3", window if sliding else None, sliding
    return cfg


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    def __init__(self, cfg: ModelConfig, *, attn_backend: str = "flash"):
        super().__init__(cfg, attn_backend=attn_backend)
        for i in cfg.sliding_layers:
            attn = self.layers[i].self_attn
            assert isinstance(attn, Olmo2Attention)
            attn.window = cfg.sliding_window


register("olmo3", olmo3_config, Olmo3ForCausalLM)
