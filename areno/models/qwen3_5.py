"""Qwen3.5 dense (``qwen3_5``, ``qwen3_5_text``) and MoE (``qwen3_5_moe``, ``qwen3_5_moe_text``): a hybrid of gated
delta net (linear attention) and gated full-attention layers; the layers and their equations are in
``qwen3_5_layers.py``.

Checkpoints: the Hub's are the vision-language composite (``Qwen3_5ForConditionalGeneration``, model_type
``qwen3_5``/``qwen3_5_moe`` with a ``text_config``), whose decoder tensors are ``model.language_model.*``; the text-only
model types (``qwen3_5_text``, ``qwen3_5_moe_text``: ``Qwen3_5ForCausalLM``) name them ``model.*``. Both load here as
a text decoder. The multi-token-prediction layers (``mtp.*``, the drafts of speculative decoding) and, in the
composite, the vision tower (``model.visual.*``: images are not taken yet) are loaded, kept frozen and replicated, and
saved untouched. MoE experts load from the per-expert names (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what
transformers writes); a checkpoint with fused expert tensors (``mlp.experts.gate_up_proj``) is refused at load by the
loader's unknown-tensor check (not supported yet).

Tensor parallelism is refused at load (``GatedDeltaNet.shard_heads``). In the rollout engine the linear-attention
layers keep a state slot per sequence (``recurrent_state_shapes``, ``areno/engine/state_cache.py``), the full
attention layers the paged K/V cache.
"""

from __future__ import annotations

from areno.models.bailing_hybrid_layers import one_layout
from areno.models.base import MLP, CausalLM, DecoderLayer
from areno.models.kept import KeptTensors
from areno.models.qwen3_5_layers import (
    GatedAttention,
    GatedDeltaNet,
    Qwen35Config,
    SharedExpertMoE,
    ZeroCenteredRMSNorm,
    check_qwen3_5,
    qwen3_5_config,
)
from areno.models.qwen3_moe import Qwen3MoeForCausalLM
from areno.models.registry import ModelCard, register

KEPT_PREFIXES = ("mtp.", "model.visual.")


class Qwen35DecoderLayer(DecoderLayer):
    """The pre-norm block with zero-centred norms."""

    def __init__(self, cfg: Qwen35Config, mlp, attn_backend: str = "flash", attn=None):
        super().__init__(cfg, mlp, attn_backend, attn)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(KeptTensors, Qwen3MoeForCausalLM):
    layer_class = Qwen35DecoderLayer

    def __init__(self, cfg: Qwen35Config, *, attn_backend: str = "flash"):
        def attn(cfg, i):
            return GatedAttention(cfg, attn_backend) if cfg.layer_types[i] == "full_attention" else GatedDeltaNet(cfg)

        CausalLM.__init__(self, cfg, attn_backend=attn_backend, attn_factory=attn,
                          mlp_factory=lambda cfg, i: SharedExpertMoE(cfg) if cfg.num_experts else MLP(cfg))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.init_kept()

    # ---- the engine's sizes --------------------------------------------------------------------------------------
    @property
    def kv_cache_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.config.layer_types) if t == "full_attention"]

    @property
    def num_kv_heads_local(self) -> int:
        full = self.kv_cache_layers
        return self.layers[full[0]].self_attn.num_kv_heads if full else 1

    def recurrent_state_shapes(self) -> dict | None:
        """Per gated-delta-net layer and sequence: ``{"layers": [i, ...], "conv": (C, W-1), "recurrent":
        (nv, dk, dv)}``; the conv state in the model dtype, the recurrent state fp32."""
        linear = [i for i, t in enumerate(self.config.layer_types) if t == "linear_attention"]
        if not linear:
            return None
        mixer = self.layers[linear[0]].self_attn
        return {"layers": linear, "conv": (mixer.conv_dim, self.config.conv_kernel - 1),
                "recurrent": (mixer.nv, mixer.dk, mixer.dv)}

    # ---- weights -------------------------------------------------------------------------------------------------
    def keep_hf_tensor(self, hf_name: str) -> bool:
        """True for the tensors held opaque: the MTP layers, and the composite checkpoint's vision tower."""
        return hf_name.startswith(KEPT_PREFIXES)

    def hf_layouts(self) -> dict:
        cfg, p = self.config, self.config.hf_prefix
        h, v = cfg.hidden_size, cfg.vocab_size
        out = {"embed_tokens.weight": one_layout(f"{p}embed_tokens.weight", v, h)}
        for i, layer in enumerate(self.layers):
            name, hf = f"layers.{i}", f"{p}layers.{i}"
            mixer = "self_attn" if cfg.layer_types[i] == "full_attention" else "linear_attn"
            out.update(layer.self_attn.layouts(f"{name}.self_attn", f"{hf}.{mixer}", cfg))
            out.update(layer.mlp.layouts(f"{name}.mlp", f"{hf}.mlp", cfg))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"{name}.{norm}.weight"] = one_layout(f"{hf}.{norm}.weight", h)
        out["norm.weight"] = one_layout(f"{p}norm.weight", h)
        if self.lm_head is not None:
            out["lm_head.weight"] = one_layout("lm_head.weight", v, h)
        out.update(self.kept_layouts())
        return out


DENSE_CARD = ModelCard("Qwen3.5", ("hybrid",), tp="no", mtp_kept=True,
                       notes="gated DeltaNet + gated attention; text only (a VL checkpoint's tower is kept and saved)")
MOE_CARD = ModelCard("Qwen3.5-MoE", ("hybrid", "moe"), tp="no", routing_replay=True, mtp_kept=True,
                     notes="gated DeltaNet + gated attention, softmax top-k experts + gated shared expert; text only")
for _type in ("qwen3_5", "qwen3_5_text"):
    register(_type, qwen3_5_config, Qwen35ForCausalLM, check_config=check_qwen3_5, card=DENSE_CARD)
for _type in ("qwen3_5_moe", "qwen3_5_moe_text"):
    register(_type, qwen3_5_config, Qwen35ForCausalLM, check_config=check_qwen3_5, card=MOE_CARD)
