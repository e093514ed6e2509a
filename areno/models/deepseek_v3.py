"""DeepSeek-V3 (``model_type: deepseek_v3``, ``DeepseekV3ForCausalLM``): a pre-norm decoder of multi-head latent
attention layers (``mla.py``) with dense SwiGLU MLPs for the first ``first_k_dense_replace`` layers and the
sigmoid-routed MoE of ``moe_layers.py`` after them (``n_group`` groups, ``topk_group`` kept, the selection bias
``e_score_correction_bias``, ``routed_scaling_factor``, ``norm_topk_prob``, ``n_shared_experts`` shared experts).

MLA here: ``q_lora_rank`` (or ``null``: ``q_proj`` directly), RoPE on the ``qk_rope_head_dim`` dims with interleaved
pairs (``rope_interleave``, the default, as transformers reads the Hub weights) or NeoX halves, and YaRN
(``rope_scaling.type: yarn``): its frequencies and cos/sin factor in the RoPE tables (``kernels/rope.py``), its
``mscale(factor, mscale_all_dim)**2`` folded into the softmax scale ``(d_nope + d_rope)**-0.5``, as transformers does.
No output gate (Ling 3 has one). The engine caches MLA as Ling 3 does (expanded per head, or the latent row).

Checkpoints keep the Hub's names (``model.layers.i.self_attn.kv_a_proj_with_mqa``, ``mlp.gate.e_score_correction_bias``,
per-expert ``mlp.experts.j.{gate,up,down}_proj``); the ``num_nextn_predict_layers`` MTP layers stored after the
decoder (``model.layers.{L+j}.*``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``, an MLA + MoE block) are loaded,
kept frozen and saved untouched (``mtp.py``). Refused at load, one line naming the option: FP8 block-quantized weights
(``quantization_config``, ``weight_scale_inv`` tensors: dequantize to bf16 first), routing other than
``scoring_func: sigmoid`` / ``topk_method: noaux_tc``, ``moe_layer_freq != 1``, a rope type other than default/yarn,
``num_key_value_heads != num_attention_heads``, an activation other than silu.
"""

from __future__ import annotations

from areno.kernels.rope import rope_params_from_config, yarn_mscale
from areno.models.base import MLP, CausalLM
from areno.models.mla import LatentAttention, LatentCacheLM, MLAConfig
from areno.models.model_config import decoder_fields, get
from areno.models.moe_layers import SigmoidMoE, SigmoidMoELM
from areno.models.mtp import KeptMTP, deepseek_mtp_parts
from areno.models.registry import ModelCard, register


def check_deepseek_v3(raw: dict) -> None:
    """Refuse a ``deepseek_v3`` config.json that names an option the adapter does not implement (one line)."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"deepseek_v3: quantization_config ({method}: block-quantized weights with weight_scale_inv) "
                         "is not supported; dequantize the checkpoint to bf16 first")
    refusals = (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1))
    for key, supported in refusals:
        if raw.get(key, supported) != supported:
            raise ValueError(f"deepseek_v3: {key}={raw[key]!r} is not supported ({supported!r} is)")


def mla_fields(hf, model_type: str) -> dict:
    """The ``MLAConfig`` fields DeepSeek-V3 and Kimi-Linear read the same way (the MLA dims, the sigmoid router)."""
    fields = decoder_fields(hf, model_type)
    heads, kv_heads = fields["num_heads"], fields["num_kv_heads"]
    if kv_heads != heads:
        raise NotImplementedError(f"{model_type}: MLA expands the latent to every head; num_key_value_heads="
                                  f"{kv_heads} != num_attention_heads={heads} is not supported")
    return dict(
        fields,
        rotary_dim=get(hf, "qk_rope_head_dim", 64),
        num_experts_per_tok=get(hf, "num_experts_per_tok", 8),
        moe_intermediate_size=get(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(get(hf, "norm_topk_prob", True)),
        q_lora_rank=get(hf, "q_lora_rank", None),
        kv_lora_rank=get(hf, "kv_lora_rank", 512),
        qk_nope_head_dim=get(hf, "qk_nope_head_dim", 128),
        qk_rope_head_dim=get(hf, "qk_rope_head_dim", 64),
        v_head_dim=get(hf, "v_head_dim", 128),
        n_group=get(hf, "n_group", 1),
        topk_group=get(hf, "topk_group", 1),
        routed_scaling_factor=float(get(hf, "routed_scaling_factor", 1.0)),
        n_shared_experts=get(hf, "n_shared_experts", 1),
    )


def deepseek_v3_config(hf) -> MLAConfig:
    if isinstance(hf, dict):
        check_deepseek_v3(hf)
    fields = mla_fields(hf, "deepseek_v3")
    # transformers' config object sets head_dim to the RoPE dim; read the RoPE from it as transformers does
    base, scaling, _ = rope_params_from_config(hf)
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise NotImplementedError(f"deepseek_v3: rope_type {kind!r} is not supported (default and yarn are)")
    qk = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    scale = qk**-0.5
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    n, dense_k = fields["num_layers"], get(hf, "first_k_dense_replace", 3)
    experts = get(hf, "n_routed_experts", None) or get(hf, "num_local_experts")
    return MLAConfig(
        **fields,
        head_dim=fields["qk_rope_head_dim"],
        rope_theta=base,
        rope_scaling=scaling,
        max_position_embeddings=get(hf, "max_position_embeddings", 4096),
        num_experts=experts,
        mlp_layer_types=["dense" if i < dense_k else "sparse" for i in range(n)],
        mla_rope="interleaved" if get(hf, "rope_interleave", True) else "neox",
        mla_softmax_scale=scale,
        num_mtp_layers=get(hf, "num_nextn_predict_layers", None) or get(hf, "num_mtp_layers", 0),
    )


class DeepseekV3ForCausalLM(LatentCacheLM, SigmoidMoELM, KeptMTP, CausalLM):
    def __init__(self, cfg: MLAConfig, *, attn_backend: str = "flash"):
        super().__init__(cfg, attn_backend=attn_backend, attn_factory=lambda cfg, i: LatentAttention(cfg, attn_backend),
                         mlp_factory=lambda cfg, i: SigmoidMoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg))
        self.init_mtp()
        self.init_mla_cache()

    def mtp_draft_parts(self) -> dict:
        """DeepSeek-V3's MTP layers: an MLA + MoE block each, their own embedding and head (areno.models.mtp)."""
        cfg, backend = self.config, self.attn_backend
        return deepseek_mtp_parts(self, lambda: self.layer_class(cfg, SigmoidMoE(cfg), backend,
                                                                 LatentAttention(cfg, backend)),
                                  attn="self_attn", final_norm="shared_head.norm", own_embed_head=True)

    def hf_layouts(self) -> dict:
        out = super().hf_layouts()  # the Llama names: model.embed_tokens, layers.i.self_attn / mlp, norms
        out.update(self.mtp_layouts())
        return out


register("deepseek_v3", deepseek_v3_config, DeepseekV3ForCausalLM, check_config=check_deepseek_v3,
         card=ModelCard("DeepSeek-V3", ("moe",), routing_replay=True, mtp_kept=True,
                        notes="MLA (latent KV cache, YaRN), sigmoid group-limited routing with bias, shared "
                              "experts; FP8 checkpoints refused (dequantize to bf16)"))
