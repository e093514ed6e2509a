"""Ling / Bailing V3 (``model_type: bailing_hybrid``, ``BailingMoeV3ForCausalLM``, e.g. Ling-3.0-Flash): a pre-norm
decoder alternating Kimi Delta Attention (linear attention) and multi-head latent attention layers by ``layer_types``,
with sparse sigmoid-routed MoE MLPs; the layers and their equations are in ``bailing_hybrid_layers.py`` (KDA),
``mla.py`` (MLA and its engine caches) and ``moe_layers.py`` (the MoE); the MTP layers are kept by ``mtp.py``.

Training uses areno's varlen ``attention`` by expanding the latent to per-head K/V (zero-padding v, or q and k, to
one head dim: zero columns change neither q.k nor the kept outputs). Checkpoints keep the Hub's tensor names
(``model.word_embeddings``, ``layers.i.attention.{dense,q_conv1d,...}``, ``mlp.gate.expert_bias``, per-expert
weights); the ``num_mtp_layers`` multi-token-prediction layers stored after the decoder (``model.layers.{L+j}.*``)
are loaded, kept (frozen, replicated) and saved untouched. The router weight, the expert bias, the conv kernels,
``dt_bias`` and ``A_log`` stay fp32 in any model dtype (as transformers keeps them).

In the rollout engine (``kv_caches``, see ``attention_metadata``): a KDA layer's cache entry is its pair of
per-sequence state pools, ``conv_state [S, 3*H*D, W-1]`` (model dtype: the last W-1 conv inputs) and the delta-rule
state ``[S, H, D, D]`` (fp32; bf16 with --mamba-ssm-cache-dtype bfloat16, the math still fp32), addressed by
``state_indices``; prefill chunks start from the slot's state and leave theirs in it (``causal_conv1d`` /
``chunk_gated_delta_rule`` with initial and final states), decode updates it in place (``causal_conv1d_update`` /
``fused_recurrent_gated_delta_rule_step``, graph-capturable).
MLA layers keep K/V expanded per head by default (``kv_head_dim`` = max(d_nope + d_rope, d_v), v zero-padded) with
``store_kvcache`` / ``paged_attention``: measured on an H200 (``bench/rollout_hybrid.py``, Ling-3.0-Flash widths, 6
layers, 256 sequences) it decodes 3.0x faster than the latent cache below (15.6k vs 5.1k tok/s; at one sequence the
latent cache is 1.04x), whose decode kernel is not tuned yet. ``set_mla_cache("latent")`` (or
``ARENO_MLA_CACHE=latent`` when the model is built) selects the latent cache (``kv_cache_layout``): per token one row
``[c | k_rope]`` of ``r + d_rope`` values
(576 for Ling 3: 1,152 bytes in bf16, against 24,576 for K and V of 32 heads at 192), in paged blocks of the same
block tables as every layer (``[num_blocks, block_size, r + d_rope]`` per layer; no V, no head axis; identical on
every TP rank, the latent projections being replicated). Each forward first writes its new tokens' rows
(``store_latent``). Decode runs in absorbed form: ``q_lat = q_nope W_uk`` per head (``W_uk``, ``W_uv``: the head's
key and value rows of ``kv_b_proj``), ``mla_decode`` (softmax over ``q_lat . c + q_rope . k_rope``, output latent
``softmax @ c``), then ``o = W_uv o_lat``, graph-capturable. Prefill without cached keys uses the new tokens' own
latents; with a cached prefix (chunked prefill, forked samples) it reads every key's row back from the cache
(``mla.cached_rows``) and expands it per head for the varlen ``attention``. The latent cache holds 21x more tokens in
the same memory (long contexts, many sequences).
"""

from __future__ import annotations

from areno.models.bailing_hybrid_layers import (
    BailingHybridConfig,
    KimiDeltaAttention,
    bailing_hybrid_config,
    check_bailing_hybrid,
)
from areno.models.base import MLP, CausalLM
from areno.models.mla import LatentAttention, LatentCacheLM
from areno.models.moe_layers import SigmoidMoE, SigmoidMoELM
from areno.models.mtp import KeptMTP, deepseek_mtp_parts
from areno.models.registry import ModelCard, register
from areno.models.tp import one_layout

__all__ = ["BailingHybridForCausalLM", "SigmoidMoE"]


class BailingHybridForCausalLM(LatentCacheLM, SigmoidMoELM, KeptMTP, CausalLM):
    delta_attention = KimiDeltaAttention  # Kimi-Linear: its low-rank gates
    hf_embed, hf_attn = "model.word_embeddings.weight", "attention"  # Hub names (Kimi-Linear: Llama's)

    def __init__(self, cfg: BailingHybridConfig, *, attn_backend: str = "flash"):
        def attn(cfg, i):
            full = cfg.layer_types[i] == "full_attention"
            return LatentAttention(cfg, attn_backend) if full else self.delta_attention(cfg)

        super().__init__(cfg, attn_backend=attn_backend, attn_factory=attn,
                         mlp_factory=lambda cfg, i: SigmoidMoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg))
        self.init_mtp()
        self.init_mla_cache()

    def recurrent_state_shapes(self) -> dict | None:
        """Per KDA layer and sequence: ``{"layers": [i, ...], "conv": (3*H*D, W-1), "recurrent": (H, D, D)}``
        (local heads under TP); the conv state in the model dtype, the recurrent state fp32 (or
        --mamba-ssm-cache-dtype's)."""
        kda = [i for i, t in enumerate(self.config.layer_types) if t == "linear_attention"]
        if not kda:
            return None
        attn = self.layers[kda[0]].self_attn
        hh, d = attn.num_heads, attn.head_dim
        return {"layers": kda, "conv": (3 * hh * d, self.config.conv_kernel - 1), "recurrent": (hh, d, d)}

    def mtp_draft_parts(self) -> dict:
        """Ling 3's MTP layers: an MLA + MoE block each, ``final_layernorm``, the model's embedding and head."""
        cfg, backend = self.config, self.attn_backend
        return deepseek_mtp_parts(self, lambda: self.layer_class(cfg, SigmoidMoE(cfg), backend,
                                                                 LatentAttention(cfg, backend)),
                                  attn=self.hf_attn, final_norm="final_layernorm", own_embed_head=False)

    # ---- weights ----------------------------------------------------------------------------------------------
    def hf_mlp(self, i: int) -> str:
        """The Hub name of layer ``i``'s MLP module."""
        return "mlp"

    def hf_layouts(self) -> dict:
        cfg = self.config
        h, v = cfg.hidden_size, cfg.vocab_size
        out = {"embed_tokens.weight": one_layout(self.hf_embed, v, h)}
        for i, layer in enumerate(self.layers):
            name, hf = f"layers.{i}", f"model.layers.{i}"
            out.update(layer.self_attn.layouts(f"{name}.self_attn", f"{hf}.{self.hf_attn}", cfg))
            out.update(layer.mlp.layouts(f"{name}.mlp", f"{hf}.{self.hf_mlp(i)}", cfg))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"{name}.{norm}.weight"] = one_layout(f"{hf}.{norm}.weight", h)
        out["norm.weight"] = one_layout("model.norm.weight", h)
        if self.lm_head is not None:
            out["lm_head.weight"] = one_layout("lm_head.weight", v, h)
        out.update(self.mtp_layouts())
        return out


register("bailing_hybrid", bailing_hybrid_config, BailingHybridForCausalLM, check_config=check_bailing_hybrid,
         card=ModelCard("Ling 3 (Bailing V3, e.g. Ling-3.0-Flash)", ("hybrid", "moe"),
                        routing_replay=True, mtp_kept=True,
                        notes="KDA linear attention + MLA, sigmoid-routed sparse MoE"))
