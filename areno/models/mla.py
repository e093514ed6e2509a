"""Multi-head latent attention (MLA), shared by the DeepSeek-style adapters (Ling 3, DeepSeek-V3, Kimi-Linear).

c = rmsnorm(x W_kva[:r]), k_rope = RoPE(x W_kva[r:]) shared by all heads, [k_nope | v] = c W_kvb per head,
q = x W_q (or q_b(rmsnorm(q_a(x))) with ``q_lora_rank``), RoPE on the last ``qk_rope_head_dim`` dims of q;
o = softmax(q k^T * scale) v, then ``o_proj``. The variants (``MLAConfig``):

- ``mla_rope``: "interleaved" (DeepSeek's pairs ``(x0, x1), (x2, x3), ...``: de-interleaving them, evens then odds,
  turns it into areno's NeoX ``apply_rope``, and the output is de-interleaved as transformers returns it), "neox"
  (``rope_interleave: false``), or "none" (Kimi-Linear: no position encoding at all, k_rope is plain).
- ``mla_output_gate``: Ling 3's head-wise ``sigmoid(x W_g)[head]`` on the attention output.
- ``mla_softmax_scale``: DeepSeek-V3's YaRN ``mscale**2`` folded into ``(d_nope + d_rope)**-0.5``.

Training runs areno's varlen ``attention`` on the latent expanded per head (v, or q and k, zero-padded to one head
dim: zero columns change neither q.k nor the kept outputs). The engine's cache (``LatentCacheLM``): K/V expanded per
head by default, or with ``set_mla_cache("latent")`` one row ``[c | k_rope]`` a token (decode in absorbed form through
``kv_b_proj``, ``mla_decode``); see ``bailing_hybrid.py`` for the measurements behind the default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from areno.config.env import env_value
from areno.kernels.attention import attention
from areno.kernels.attention.mla import mla_decode, store_latent
from areno.kernels.attention.paged import paged_attention, store_kvcache
from areno.kernels.rope import apply_rope
from areno.models.layers import Linear, RMSNorm
from areno.models.model_config import ModelConfig
from areno.models.tp import copy_to_tp, layout, one_layout

MLA_CACHES = ("latent", "expanded")  # the engine's paged cache of the MLA layers
MLA_ROPES = ("interleaved", "neox", "none")


@dataclass
class MLAConfig(ModelConfig):
    """``ModelConfig`` plus the MLA, sigmoid-routed MoE and kept-MTP fields of the DeepSeek-style families."""

    mlp_layer_types: list[str] = field(default_factory=list)  # "dense" | "sparse"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_rope: str = "interleaved"
    mla_output_gate: bool = False
    mla_softmax_scale: float | None = None  # None: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
    hf_o_proj: str = "o_proj"  # the Hub name of the attention output projection (Ling 3: "dense")
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 1
    hf_router_bias: str = "e_score_correction_bias"  # the Hub name of the selection bias (Ling 3: "expert_bias")
    hf_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Kimi-Linear: w1, w3, w2
    num_mtp_layers: int = 0

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"


def rope_interleaved(x, positions, rope):
    """DeepSeek's interleaved-pair RoPE of ``x [T, H, r]``, output de-interleaved as transformers returns it."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), positions, *rope)


def _rope(kind: str, x, positions, rope):
    if kind == "interleaved":
        return rope_interleaved(x, positions, rope)
    return apply_rope(x, positions, *rope) if kind == "neox" else x


class LatentAttention(nn.Module):
    def __init__(self, cfg: MLAConfig, attn_backend: str = "flash"):
        super().__init__()
        h, hh = cfg.hidden_size, cfg.num_heads
        self.num_heads = hh
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.q_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        self.rope_kind = cfg.mla_rope
        qk = self.nope + self.rope_dim
        if self.q_rank is None:
            self.q_proj = Linear(h, hh * qk)
        else:
            self.q_a_proj = Linear(h, self.q_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_rank, 1e-6)
            self.q_b_proj = Linear(self.q_rank, hh * qk)
        self.kv_a_proj = Linear(h, self.rank + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, hh * (self.nope + self.v_dim))
        self.g_proj = Linear(h, hh) if cfg.mla_output_gate else None
        self.o_proj = Linear(hh * self.v_dim, h, bias=cfg.attention_bias)
        self.scale = cfg.mla_softmax_scale or qk**-0.5
        self.backend = "native" if attn_backend == "native" else None

    def shard_heads(self, rank: int, size: int) -> None:
        self.num_heads //= size

    def forward(self, x, positions, rope, meta, kv_cache=None):
        t, hh, nope, r = x.shape[0], self.num_heads, self.nope, self.rope_dim
        q = self.q_proj(x) if self.q_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, hh, nope + r)
        latent, k_rot = self.kv_a_proj(x).split([self.rank, r], dim=-1)
        latent = self.kv_a_layernorm(latent)
        # k_rot is shared by this rank's heads only: its gradient is summed over the TP group
        k_rot = copy_to_tp(_rope(self.rope_kind, k_rot.reshape(t, 1, r), positions, rope), self.kv_b_proj.tp_group)
        q = torch.cat([q[..., :nope], _rope(self.rope_kind, q[..., nope:], positions, rope)], dim=-1)
        latent_cache = kv_cache is not None and len(kv_cache) == 1  # else (k_cache, v_cache) expanded per head
        if latent_cache:  # the new tokens' rows first: decode and a cached prefix read them from the cache
            store_latent(torch.cat([latent, k_rot.view(t, r)], dim=-1), kv_cache[0], meta.slot_mapping)
            if not meta.is_prefill:
                return self._output(self._decode_absorbed(q, kv_cache[0], meta), x)
            if meta.has_prefix:  # every key of each sequence, expanded from its cached rows
                latent, k_rot = cached_rows(kv_cache[0], meta).split([self.rank, r], dim=-1)
                k_rot = k_rot.unsqueeze(1)
        kv = self.kv_b_proj(latent).view(-1, hh, nope + self.v_dim)
        k_nope, v = kv.split([nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, hh, r)], dim=-1)
        width = max(nope + r, self.v_dim)
        q, k, v = (F.pad(z, (0, width - z.shape[-1])) if z.shape[-1] < width else z for z in (q, k, v))
        if kv_cache is not None and not latent_cache:
            store_kvcache(k, v, *kv_cache, meta.slot_mapping)
        if kv_cache is not None and not latent_cache and (not meta.is_prefill or meta.has_prefix):
            multi = (dict(cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q) if meta.is_prefill
                     else {"split_rows": meta.split_rows})
            o = paged_attention(q, *kv_cache, meta.block_table, meta.seq_lens, softmax_scale=self.scale, **multi)
        else:
            o = attention(
                q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
                causal=True, softmax_scale=self.scale, backend=self.backend,
            )  # fmt: skip
        return self._output(o[..., : self.v_dim], x)

    def _decode_absorbed(self, q, cache, meta):
        """``[T, H, d_v]`` of one decode token per sequence against the latent cache: ``q_nope`` absorbed through the
        heads' key rows of ``kv_b_proj`` (``W_uk [H, d_nope, r]``), ``mla_decode``, then their value rows ``W_uv``."""
        nope, hh = self.nope, self.num_heads
        w = self.kv_b_proj.weight.view(hh, nope + self.v_dim, self.rank)
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)  # [T, H, r]
        o_lat = mla_decode(torch.cat([q_lat, q[..., nope:]], dim=-1), cache, meta.block_table, meta.seq_lens,
                           kv_lora_rank=self.rank, softmax_scale=self.scale, split_rows=meta.split_rows)
        return torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)

    def _output(self, o, x):
        """The head-wise sigmoid gate (Ling 3), then the output projection of ``o [T, H, d_v]``."""
        t = x.shape[0]
        if self.g_proj is not None:
            gate = torch.sigmoid(self.g_proj(x).float()).to(x.dtype)
            o = o * gate.unsqueeze(-1)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def layouts(self, name: str, hf: str, cfg: MLAConfig) -> dict:
        h, hh, r, qk = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        kva, hv, o = r + cfg.qk_rope_head_dim, hh * cfg.v_head_dim, f"{hf}.{cfg.hf_o_proj}"
        out = {
            f"{name}.kv_a_proj.weight": one_layout(f"{hf}.kv_a_proj_with_mqa.weight", kva, h),
            f"{name}.kv_a_layernorm.weight": one_layout(f"{hf}.kv_a_layernorm.weight", r),
            f"{name}.kv_b_proj.weight": one_layout(f"{hf}.kv_b_proj.weight", hh * cfg.qk_nope_head_dim + hv, r),
            f"{name}.o_proj.weight": [layout((h, hv), 1, [(f"{o}.weight", hv)])],
        }
        if cfg.mla_output_gate:
            out[f"{name}.g_proj.weight"] = one_layout(f"{hf}.g_proj.weight", hh, h)
        if cfg.q_lora_rank is None:
            out[f"{name}.q_proj.weight"] = one_layout(f"{hf}.q_proj.weight", hh * qk, h)
        else:
            q = cfg.q_lora_rank
            out[f"{name}.q_a_proj.weight"] = one_layout(f"{hf}.q_a_proj.weight", q, h)
            out[f"{name}.q_a_layernorm.weight"] = one_layout(f"{hf}.q_a_layernorm.weight", q)
            out[f"{name}.q_b_proj.weight"] = one_layout(f"{hf}.q_b_proj.weight", hh * qk, q)
        if cfg.attention_bias:
            out[f"{name}.kv_a_proj.bias"] = one_layout(f"{hf}.kv_a_proj_with_mqa.bias", kva)
            out[f"{name}.o_proj.bias"] = one_layout(f"{o}.bias", h)
            if cfg.q_lora_rank is not None:
                out[f"{name}.q_a_proj.bias"] = one_layout(f"{hf}.q_a_proj.bias", cfg.q_lora_rank)
        return out


def cached_rows(cache, meta):
    """The latent-cache rows ``[sum(seq_lens), r + d_rope]`` of every token of each sequence, in order (packed as
    ``cu_seqlens_k``); prefill only (one host read for the total)."""
    lens, bs = meta.seq_lens.long(), cache.shape[1]
    cu = meta.cu_seqlens_k.long()
    total = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
    j = torch.arange(total, device=lens.device) - cu[seq]
    return cache[meta.block_table[seq, j // bs].long(), j % bs]


class LatentCacheLM:
    """Mixin for a ``CausalLM`` with ``LatentAttention`` layers: the engine's sizes of their paged cache."""

    def init_mla_cache(self) -> None:
        self.set_mla_cache((env_value("ARENO_MLA_CACHE") or "expanded").strip().lower() or "expanded")

    @property
    def kv_cache_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer.self_attn, LatentAttention)]

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
        decode today) or "latent" (21x less cache memory a token at Ling 3's widths); the environment variable
        ``ARENO_MLA_CACHE`` sets the default."""
        if kind not in MLA_CACHES:
            raise ValueError(f"MLA cache must be one of {MLA_CACHES} (ARENO_MLA_CACHE), got {kind!r}")
        self.mla_cache = kind
