"""Ling / Bailing V3 (``model_type: bailing_hybrid``, ``BailingMoeV3ForCausalLM``, e.g. Ling-3.0-Flash): a pre-norm
decoder alternating Kimi Delta Attention (linear attention) and multi-head latent attention layers by ``layer_types``,
with sparse sigmoid-routed MoE MLPs; the layers and their equations are in ``bailing_hybrid_layers.py``.

Training uses areno's varlen ``attention`` by expanding the latent to per-head K/V (zero-padding v, or q and k, to
one head dim: zero columns change neither q.k nor the kept outputs). Checkpoints keep the Hub's tensor names
(``model.word_embeddings``, ``layers.i.attention.{dense,q_conv1d,...}``, ``mlp.gate.expert_bias``, per-expert
weights); the ``num_mtp_layers`` multi-token-prediction layers stored after the decoder (``model.layers.{L+j}.*``)
are loaded, kept (frozen, replicated) and saved untouched. The router weight, the expert bias, the conv kernels,
``dt_bias`` and ``A_log`` stay fp32 in any model dtype (as transformers keeps them).

In the rollout engine (``kv_caches``, see ``attention_metadata``): a KDA layer's cache entry is its pair of
per-sequence state pools, ``conv_state [S, 3*H*D, W-1]`` (model dtype: the last W-1 conv inputs) and the delta-rule
state ``[S, H, D, D]`` (fp32), addressed by ``state_indices``; prefill chunks start from the slot's state and leave
theirs in it (``causal_conv1d`` / ``chunk_gated_delta_rule`` with initial and final states), decode updates it in place
(``causal_conv1d_update`` / ``fused_recurrent_gated_delta_rule_step``, graph-capturable).
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
(``_cached_rows``) and expands it per head for the varlen ``attention``. The latent cache holds 21x more tokens in
the same memory (long contexts, many sequences).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areno.config.env import env_value
from areno.models.bailing_hybrid_layers import (
    BailingHybridConfig,
    KimiDeltaAttention,
    LatentAttention,
    SigmoidMoE,
    bailing_hybrid_config,
    check_bailing_hybrid,
    one_layout,
)
from areno.models.base import MLP, CausalLM
from areno.models.layers import KeptTensors
from areno.models.registry import ModelCard, register

MLA_CACHES = ("latent", "expanded")  # the engine's paged cache of the MLA layers (see the module docstring)


class BailingHybridForCausalLM(CausalLM):
    has_routing_bias = True  # the sigmoid routers' selection bias (update_routing_bias)

    def __init__(self, cfg: BailingHybridConfig, *, attn_backend: str = "flash"):
        def attn(cfg, i):
            full = cfg.layer_types[i] == "full_attention"
            return LatentAttention(cfg, attn_backend) if full else KimiDeltaAttention(cfg)

        super().__init__(cfg, attn_backend=attn_backend, attn_factory=attn,
                         mlp_factory=lambda cfg, i: SigmoidMoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg))
        self.mtp = KeptTensors()  # frozen, opaque tensors of the MTP layers, filled at load (see keep_hf_tensor)
        self.set_mla_cache((env_value("ARENO_MLA_CACHE") or "expanded").strip().lower() or "expanded")

    # ---- the engine's sizes (see the module docstring) ---------------------------------------------------------
    @property
    def kv_cache_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.config.layer_types) if t == "full_attention"]

    @property
    def num_kv_heads_local(self) -> int:
        return self.layers[self.kv_cache_layers[0]].self_attn.num_heads if self.kv_cache_layers else 1

    @property
    def kv_head_dim(self) -> int:
        cfg = self.config
        return max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)

    @property
    def kv_cache_layout(self) -> tuple[int, tuple[int, ...]]:
        """(tensors per MLA layer, per-token shape) of the engine's paged cache: the latent row ``(1, (r + d_rope,))``,
        or with ``mla_cache == "expanded"`` K and V per head ``(2, (H_local, kv_head_dim))``."""
        if self.mla_cache == "expanded":
            return 2, (self.num_kv_heads_local, self.kv_head_dim)
        return 1, (self.config.kv_lora_rank + self.config.qk_rope_head_dim,)

    def set_mla_cache(self, kind: str) -> None:
        """Choose the MLA layers' engine cache for the engines built after this call: "expanded" (the default: faster
        decode today) or "latent" (21x less cache memory a token); the environment variable ``ARENO_MLA_CACHE`` sets
        the default."""
        if kind not in MLA_CACHES:
            raise ValueError(f"MLA cache must be one of {MLA_CACHES} (ARENO_MLA_CACHE), got {kind!r}")
        self.mla_cache = kind

    def recurrent_state_shapes(self) -> dict | None:
        """Per KDA layer and sequence: ``{"layers": [i, ...], "conv": (3*H*D, W-1), "recurrent": (H, D, D)}``
        (local heads under TP); the conv state in the model dtype, the recurrent state fp32."""
        kda = [i for i, t in enumerate(self.config.layer_types) if t == "linear_attention"]
        if not kda:
            return None
        attn = self.layers[kda[0]].self_attn
        hh, d = attn.num_heads, attn.head_dim
        return {"layers": kda, "conv": (3 * hh * d, self.config.conv_kernel - 1), "recurrent": (hh, d, d)}

    # ---- MoE load counters and the selection bias ---------------------------------------------------------------
    def moe_layers(self) -> list[SigmoidMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SigmoidMoE)]

    def expert_load(self) -> torch.Tensor:
        """int64 ``[num_moe_layers, E]``: (token, slot) pairs routed to each expert by training forwards."""
        return torch.stack([m.expert_load for m in self.moe_layers()])

    def reset_expert_load(self) -> None:
        for m in self.moe_layers():
            m.expert_load.zero_()

    @torch.no_grad()
    def update_routing_bias(self, rate: float, dp_group=None) -> None:
        """One sign-based step of the selection bias (auxiliary-loss-free balancing), then counters reset:
        ``bias_e += rate * sign(mean_e' load_e' - load_e)`` per MoE layer, loads summed over data-parallel ranks
        (TP ranks route identically, so their counts already agree). ``rate == 0`` only resets the counters."""
        layers = self.moe_layers()
        if not layers:
            return
        if rate:
            load = self.expert_load().float()
            if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
                dist.all_reduce(load, group=dp_group)
            step = rate * torch.sign(load.mean(dim=-1, keepdim=True) - load)
            for m, s in zip(layers, step):
                m.gate.expert_bias.add_(s.to(m.gate.expert_bias.dtype))
        self.reset_expert_load()

    # ---- weights ----------------------------------------------------------------------------------------------
    def keep_hf_tensor(self, hf_name: str) -> bool:
        """True for checkpoint tensors kept opaque: those of the MTP layers after the decoder."""
        if not hf_name.startswith("model.layers."):
            return False
        index = hf_name.split(".")[2]
        return index.isdigit() and int(index) >= self.config.num_layers

    @property
    def mtp_names(self) -> list[str]:
        return self.mtp.names

    def add_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> str:
        """Hold ``tensor`` as a frozen, replicated parameter saved back under ``hf_name``; returns its name."""
        return f"mtp.{self.mtp.add(hf_name, tensor)}"

    def hf_layouts(self) -> dict:
        cfg = self.config
        h, v = cfg.hidden_size, cfg.vocab_size
        out = {"embed_tokens.weight": one_layout("model.word_embeddings.weight", v, h)}
        for i, layer in enumerate(self.layers):
            name, hf = f"layers.{i}", f"model.layers.{i}"
            out.update(layer.self_attn.layouts(f"{name}.self_attn", f"{hf}.attention", cfg))
            out.update(layer.mlp.layouts(f"{name}.mlp", f"{hf}.mlp", cfg))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"{name}.{norm}.weight"] = one_layout(f"{hf}.{norm}.weight", h)
        out["norm.weight"] = one_layout("model.norm.weight", h)
        if self.lm_head is not None:
            out["lm_head.weight"] = one_layout("lm_head.weight", v, h)
        out.update(self.mtp.layouts("mtp"))
        return out


register("bailing_hybrid", bailing_hybrid_config, BailingHybridForCausalLM, check_config=check_bailing_hybrid,
         card=ModelCard("Ling 3 (Bailing V3, e.g. Ling-3.0-Flash)", ("hybrid", "moe"),
                        routing_replay=True, mtp_kept=True,
                        notes="KDA linear attention + MLA, sigmoid-routed sparse MoE"))
