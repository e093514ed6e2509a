"""Hugging Face tensor names and shapes of a tiny Gemma 4 text model (``gemma4_text``; ``gemma4`` puts the same under
``model.language_model.``), read from its ``config.json`` dict, and the tiny config's defaults.

Layers: per-layer head dim / KV heads from ``per_layer_config`` (what transformers writes), KV-shared layers without
k/v tensors, the MoE block beside the dense MLP, per-layer inputs (PLE), a ``layer_scalar`` buffer per layer.
"""

from __future__ import annotations

# Tiny-config variants the tests share: KV-shared layers + per-layer inputs + k = v + double-wide MLPs; the MoE block
SHARED_PLE = dict(num_kv_shared_layers=2, hidden_size_per_layer_input=8, attention_k_eq_v=True,
                  use_double_wide_mlp=True)
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
EVERY_FEATURE = {**SHARED_PLE, **MOE}

# Init values near 1 (norm scales, the layer scalar, the router's scales): drawn as 1 + N(0, 0.05) like norms.
ONE_LIKE = ("norm.weight", "layernorm_1.weight", "layernorm_2.weight", "layer_scalar", "router.scale",
            "per_expert_scale")


def gemma4_defaults(cfg: dict) -> dict:
    """A sliding, full, sliding, full stack; window 4; sliding head dim 16 / 2 KV heads, full 32 / 1 (proportional
    RoPE on a quarter); soft-capping at 3 (the tiny logits are ~1: a cap of 30 would change nothing)."""
    for key in ("hidden_act", "rope_theta"):
        cfg.pop(key, None)
    cfg.update(
        num_hidden_layers=4, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=False, final_logit_softcapping=3.0,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=cfg["vocab_size"], num_kv_shared_layers=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
    )  # fmt: skip
    return cfg


def gemma4_config(text: dict) -> dict:
    """The ``config.json`` of a ``gemma4`` checkpoint around the ``gemma4_text`` config ``text``, without towers."""
    import transformers

    config = transformers.Gemma4Config(text_config=dict(text), vision_config=None, audio_config=None,
                                       tie_word_embeddings=text.get("tie_word_embeddings", True))
    out = config.to_diff_dict()
    out["text_config"] = dict(text)
    out["architectures"] = ["Gemma4ForConditionalGeneration"]
    out.setdefault("dtype", text.get("dtype"))
    out["initializer_range"] = text["initializer_range"]
    return dict(sorted(out.items()))


def _kv_shared(config: dict) -> list[bool]:
    n, shared = config["num_hidden_layers"], config.get("num_kv_shared_layers", 0)
    return [i >= n - shared for i in range(n)]


def gemma4_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    text = config.get("text_config", config)
    prefix = "model.language_model." if config["model_type"] == "gemma4" else "model."
    hidden, vocab, n = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    over = {int(k): v for k, v in (text.get("per_layer_config") or {}).items()}
    ple, inter = text.get("hidden_size_per_layer_input") or 0, text["intermediate_size"]
    shapes = {prefix + "embed_tokens.weight": (vocab, hidden)}
    if ple:
        shapes[prefix + "embed_tokens_per_layer.weight"] = (text["vocab_size_per_layer_input"], n * ple)
        shapes[prefix + "per_layer_model_projection.weight"] = (n * ple, hidden)
        shapes[prefix + "per_layer_projection_norm.weight"] = (ple,)
    for i, shared in enumerate(_kv_shared(text)):
        p, full = f"{prefix}layers.{i}.", text["layer_types"][i] == "full_attention"
        d, hkv = over.get(i, {}).get("head_dim", head_dim), over.get(i, {}).get("num_key_value_heads", kv_heads)
        a = p + "self_attn."
        shapes.update({p + "input_layernorm.weight": (hidden,), a + "q_proj.weight": (heads * d, hidden),
                       a + "q_norm.weight": (d,)})
        if not shared:
            shapes.update({a + "k_proj.weight": (hkv * d, hidden), a + "k_norm.weight": (d,)})
            if not (text.get("attention_k_eq_v") and full):
                shapes[a + "v_proj.weight"] = (hkv * d, hidden)
        shapes[a + "o_proj.weight"] = (hidden, heads * d)
        width = inter * (2 if shared and text.get("use_double_wide_mlp") else 1)
        shapes.update({p + "mlp.gate_proj.weight": (width, hidden), p + "mlp.up_proj.weight": (width, hidden),
                       p + "mlp.down_proj.weight": (hidden, width)})
        for norm in ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            shapes[p + norm + ".weight"] = (hidden,)
        if text.get("enable_moe_block"):
            e, m = text["num_experts"], text["moe_intermediate_size"]
            shapes.update({p + "router.proj.weight": (e, hidden), p + "router.scale": (hidden,),
                           p + "router.per_expert_scale": (e,), p + "experts.gate_up_proj": (e, 2 * m, hidden),
                           p + "experts.down_proj": (e, hidden, m)})
            for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                shapes[p + norm + ".weight"] = (hidden,)
        if ple:
            shapes.update({p + "per_layer_input_gate.weight": (ple, hidden),
                           p + "per_layer_projection.weight": (hidden, ple),
                           p + "post_per_layer_input_norm.weight": (hidden,)})
        shapes[p + "layer_scalar"] = (1,)
    shapes[prefix + "norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes
