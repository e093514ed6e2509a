"""Tiny Qwen3.5 checkpoints (``qwen3_5``: dense, ``qwen3_5_moe``: MoE) for ``areno.testing.checkpoints``: config
defaults, Hub tensor names and shapes (text-only layout ``model.*``), including ``mtp_num_hidden_layers`` MTP layers
(``mtp.*``, which transformers skips and areno keeps untouched)."""

from __future__ import annotations

FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def defaults(family: str) -> dict:
    """[GDN, attention, GDN, attention]; 2 key heads of 16 serving 4 value heads of 8 (dk != dv, nv = 2 nk)."""
    cfg = dict(tie_word_embeddings=False, num_hidden_layers=4, full_attention_interval=2,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
               linear_conv_kernel_dim=4, mtp_num_hidden_layers=1,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if family == "qwen3_5_moe":
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return cfg


def zero_centered(name: str) -> bool:
    """Norm weights stored as ``weight`` where the model scales by ``1 + weight`` (drawn near 0, not near 1)."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def _mlp(config: dict, p: str, moe: bool) -> dict:
    hidden = config["hidden_size"]
    if not moe:
        inter = config["intermediate_size"]
        return {p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden),
                p + "down_proj.weight": (hidden, inter)}
    experts, inter, shared = config["num_experts"], config["moe_intermediate_size"], \
        config["shared_expert_intermediate_size"]
    shapes = {p + "gate.weight": (experts, hidden)}
    for e in range(experts):
        shapes.update({p + f"experts.{e}.gate_proj.weight": (inter, hidden),
                       p + f"experts.{e}.up_proj.weight": (inter, hidden),
                       p + f"experts.{e}.down_proj.weight": (hidden, inter)})
    shapes.update({p + "shared_expert.gate_proj.weight": (shared, hidden),
                   p + "shared_expert.up_proj.weight": (shared, hidden),
                   p + "shared_expert.down_proj.weight": (hidden, shared),
                   p + "shared_expert_gate.weight": (1, hidden)})
    return shapes


def _layer(config: dict, p: str, full: bool, moe: bool) -> dict:
    hidden, heads, kv, d = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                            config["head_dim"])
    shapes = {p + "input_layernorm.weight": (hidden,)}
    if full:
        a = p + "self_attn."
        shapes.update({a + "q_proj.weight": (2 * heads * d, hidden), a + "k_proj.weight": (kv * d, hidden),
                       a + "v_proj.weight": (kv * d, hidden), a + "o_proj.weight": (hidden, heads * d),
                       a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
    else:
        a = p + "linear_attn."
        nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
        kd, vd = nk * config["linear_key_head_dim"], nv * config["linear_value_head_dim"]
        shapes.update({a + "in_proj_qkv.weight": (2 * kd + vd, hidden), a + "in_proj_z.weight": (vd, hidden),
                       a + "in_proj_b.weight": (nv, hidden), a + "in_proj_a.weight": (nv, hidden),
                       a + "conv1d.weight": (2 * kd + vd, 1, config["linear_conv_kernel_dim"]),
                       a + "dt_bias": (nv,), a + "A_log": (nv,),
                       a + "norm.weight": (config["linear_value_head_dim"],), a + "out_proj.weight": (hidden, vd)})
    shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes.update(_mlp(config, p + "mlp.", moe))
    return shapes


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    moe = config["model_type"] == "qwen3_5_moe_text"
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i, kind in enumerate(config["layer_types"]):
        shapes.update(_layer(config, f"model.layers.{i}.", kind == "full_attention", moe))
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    for j in range(config.get("mtp_num_hidden_layers", 0)):  # the Hub's MTP names: opaque to transformers
        shapes.update({"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
                       "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)})
        shapes.update(_layer(config, f"mtp.layers.{j}.", True, moe))
    return shapes
