"""OLMo 3: OLMo 2's post-norm, full-projection QK-norm decoder with sliding-window attention on some layers.

``config.layer_types`` names each layer ``sliding_attention`` (its queries see the last ``sliding_window`` keys,
their own included, as transformers' mask) or ``full_attention``; the attention kernels take the window (``window=``)
on every path, skipping key blocks left of it. transformers gives each layer type its own
RoPE (a legacy ``rope_scaling`` lands on the full layers only): the sliding layers get their own table when it
differs. Unknown layer types are refused at load in one line.
"""

from __future__ import annotations

from areno.kernels.rope import rope_cos_sin, rope_params_from_config
from areno.models.model_config import ModelConfig, get
from areno.models.olmo2 import Olmo2Attention, Olmo2ForCausalLM, olmo2_config
from areno.models.registry import ModelCard, register

LAYER_TYPES = ("sliding_attention", "full_attention")


def _type_rope(raw: dict, layer_type: str) -> tuple[float, dict | None, int]:
    """``(theta, scaling, rotary_dim)`` of one layer type (transformers 5 keys ``rope_parameters`` by layer type)."""
    params = get(raw, "rope_parameters", None) or {}
    if any(t in params for t in LAYER_TYPES):
        params = dict(params.get(layer_type) or {})
    return rope_params_from_config({**raw, "rope_parameters": params})


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
    full, slide = _type_rope(raw, "full_attention"), _type_rope(raw, "sliding_attention")
    if full[2] != slide[2]:
        raise NotImplementedError(f"olmo3: partial_rotary_factor differs between layer types ({full[2]} vs "
                                  f"{slide[2]} rotary dims)")
    cfg = olmo2_config({**raw, "rope_parameters": {}, "rope_scaling": None})
    cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim = full
    cfg.model_type, cfg.sliding_window, cfg.sliding_layers = "olmo3", window if sliding else None, sliding
    cfg.sliding_rope = slide[:2] if sliding and slide[:2] != full[:2] else None
    return cfg


class Olmo3Attention(Olmo2Attention):
    """OLMo 2's attention with the layer's sliding window and, when its layer type has its own, RoPE table."""

    def __init__(self, cfg: ModelConfig, attn_backend: str = "flash"):
        super().__init__(cfg, attn_backend)
        self.rope_table = None  # set by Olmo3ForCausalLM.init_buffers on sliding layers with their own RoPE

    def forward(self, x, positions, rope, meta, kv_cache=None):
        return super().forward(x, positions, self.rope_table or rope, meta, kv_cache)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    attention_class = Olmo3Attention

    def __init__(self, cfg: ModelConfig, *, attn_backend: str = "flash"):
        super().__init__(cfg, attn_backend=attn_backend)
        for i in cfg.sliding_layers:
            self.layers[i].self_attn.window = cfg.sliding_window

    def init_buffers(self, device=None) -> None:
        super().init_buffers(device)
        cfg = self.config
        if cfg.sliding_rope is None:
            return
        theta, scaling = cfg.sliding_rope
        table = rope_cos_sin(cfg.rotary_dim, cfg.max_position_embeddings, theta, rope_scaling=scaling,
                             device=self.rope[0].device)
        for i in cfg.sliding_layers:
            self.layers[i].self_attn.rope_table = table


register("olmo3", olmo3_config, Olmo3ForCausalLM,
         card=ModelCard("OLMo 3", tp="must divide the KV heads",
                        notes="OLMo 2 + sliding-window layers, a RoPE per layer type"))
