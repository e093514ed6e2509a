"""Ling / Bailing V3 (``bailing_hybrid``) building blocks: the config, the token mixers and the sparse MoE.

A pre-norm decoder whose token mixer alternates by ``layer_types``:

- ``linear_attention``: Kimi Delta Attention (KDA). Per head h with ``D = head_dim`` (the config's KDA head dim):
  q, k, v = silu(causal depthwise conv_W(x W_{q,k,v}))   (one short conv over the concatenated q|k|v channels)
  q, k <- l2-normalised (x / sqrt(sum x^2 + 1e-6)),  beta = sigmoid(x W_b) [H]
  g = kda_lower_bound * sigmoid(exp(A_log) * (x W_f + dt_bias))  per channel, log-decay in [lower_bound, 0]
      (``kda_safe_gate=false``: g = -exp(A_log) * softplus(x W_f + dt_bias))
  S_t = diag(exp g_t) S_{t-1};  S_t += k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = S_t^T q_t / sqrt(D)
  out = o_proj(rmsnorm_D(o) * w_o * sigmoid(x W_g))   (the gated RMSNorm, fp32)
- ``full_attention`` (every ``layer_group_size``-th layer): multi-head latent attention (MLA) with a head-wise
  output gate. c = rmsnorm(x W_kva[:r]), k_rope = RoPE(x W_kva[r:]) shared by all heads, [k_nope | v] = c W_kvb
  per head, q = x W_q (or q_b(rmsnorm(q_a(x))) with ``q_lora_rank``), RoPE on the last ``qk_rope_head_dim`` dims
  of q; softmax(q k^T / sqrt(d_nope + d_rope)) v * sigmoid(x W_g)[head]; RoPE pairs are interleaved (DeepSeek):
  de-interleaving them (evens, then odds) turns it into areno's NeoX ``apply_rope``.
- MLP: dense SwiGLU for the ``first_k_dense_replace`` layers, then sparse MoE: sigmoid scores, a per-expert fp32
  bias (``expert_bias``) that steers the group-limited top-k selection only, weights renormalised and scaled by
  ``routed_scaling_factor``, plus one always-on shared expert.

The model (engine sizes, MoE balancing, MTP tensors, Hub layouts) is ``bailing_hybrid.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from areno.kernels.attention import attention
from areno.kernels.attention.mla import mla_decode, store_latent
from areno.kernels.attention.paged import paged_attention, store_kvcache
from areno.kernels.linear_attn.delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule_step
from areno.kernels.linear_attn.short_conv import causal_conv1d, causal_conv1d_update
from areno.kernels.moe import fused_moe
from areno.kernels.moe.routing import route_sigmoid_grouped_topk
from areno.kernels.rope import apply_rope
from areno.models.base import MLP
from areno.models.layers import Linear, RMSNorm
from areno.models.model_config import ModelConfig, get
from areno.models.qwen3_moe import Experts, replay_routes
from areno.models.tp import copy_to_tp, layout, reduce_from_tp

ARCHITECTURES = ("BailingMoeV3ForCausalLM", "BailingHybridForCausalLM")


@dataclass
class BailingHybridConfig(ModelConfig):
    layer_types: list[str] = field(default_factory=list)  # "linear_attention" (KDA) | "full_attention" (MLA)
    mlp_layer_types: list[str] = field(default_factory=list)  # "dense" | "sparse"
    conv_kernel: int = 4
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 1
    num_mtp_layers: int = 0

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"


def check_bailing_hybrid(raw: dict) -> None:
    """Refuse a ``bailing_hybrid`` config.json that is not Ling 3 (the model_type also named Ling 2.5/2.6 hybrids
    with lightning linear attention in remote-code checkpoints)."""
    archs = list(raw.get("architectures") or [])
    kda_fields = "short_conv_kernel_size" in raw or "kda_lower_bound" in raw
    if archs and not any(a in ARCHITECTURES for a in archs):
        raise ValueError(
            f"bailing_hybrid checkpoint with architectures {archs} is not Ling 3 (KDA + MLA): areno supports "
            f"{list(ARCHITECTURES)}; the earlier Ling 2.x hybrid (lightning linear attention, e.g. "
            "BailingMoeV2_5ForCausalLM) shares the model_type but is a different architecture and is not supported")
    if not archs and not kda_fields:
        raise ValueError("bailing_hybrid config.json names no architectures and has no KDA fields "
                         "(short_conv_kernel_size, kda_lower_bound): not a Ling 3 checkpoint areno can read")
    unknown = sorted(set(raw.get("layer_types") or []) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"bailing_hybrid: layer_types {unknown} are not Ling 3 layers (linear_attention = KDA, "
                         "full_attention = MLA)")


def bailing_hybrid_config(hf) -> BailingHybridConfig:
    if isinstance(hf, dict):
        check_bailing_hybrid(hf)
    act = get(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise NotImplementedError(f"bailing_hybrid: hidden_act {act!r} is not supported (silu is)")
    rope = dict(get(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"bailing_hybrid: rope_type {rope.get('rope_type')!r} is not supported (default is)")
    heads, n = get(hf, "num_attention_heads"), get(hf, "num_hidden_layers")
    kv_heads = get(hf, "num_key_value_heads", heads)
    if kv_heads != heads:
        raise NotImplementedError(f"bailing_hybrid: MLA expands the latent to every head; num_key_value_heads="
                                  f"{kv_heads} != num_attention_heads={heads} is not supported")
    group, dense_k = get(hf, "layer_group_size", 6), get(hf, "first_k_dense_replace", 2)
    layer_types = list(get(hf, "layer_types", None) or
                       ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)])
    mlp_types = list(get(hf, "mlp_layer_types", None) or ["dense" if i < dense_k else "sparse" for i in range(n)])
    experts = get(hf, "num_local_experts", None) or get(hf, "num_experts", 0)
    # transformers' config object moves the KDA head dim to linear_head_dim (head_dim becomes the RoPE dim); a raw
    # config.json has it as head_dim
    head_dim = get(hf, "linear_head_dim", None) or get(hf, "head_dim")
    return BailingHybridConfig(
        model_type="bailing_hybrid",
        vocab_size=get(hf, "vocab_size"),
        hidden_size=get(hf, "hidden_size"),
        intermediate_size=get(hf, "intermediate_size"),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        rms_norm_eps=get(hf, "rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", get(hf, "rope_theta", 6e6)),
        rotary_dim=get(hf, "qk_rope_head_dim", 64),
        max_position_embeddings=get(hf, "max_position_embeddings", None) or get(hf, "model_max_length", 4096),
        tie_word_embeddings=bool(get(hf, "tie_word_embeddings", False)),
        attention_bias=bool(get(hf, "attention_bias", False)),
        num_experts=experts,
        num_experts_per_tok=get(hf, "num_experts_per_tok", None) or get(hf, "num_experts_per_token", 8),
        moe_intermediate_size=get(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(get(hf, "norm_topk_prob", get(hf, "moe_renormalize", True))),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        conv_kernel=get(hf, "short_conv_kernel_size", 4),
        kda_safe_gate=bool(get(hf, "kda_safe_gate", True)),
        kda_lower_bound=float(get(hf, "kda_lower_bound", -5.0)),
        q_lora_rank=get(hf, "q_lora_rank", None),
        kv_lora_rank=get(hf, "kv_lora_rank", 512),
        qk_nope_head_dim=get(hf, "qk_nope_head_dim", 128),
        qk_rope_head_dim=get(hf, "qk_rope_head_dim", 64),
        v_head_dim=get(hf, "v_head_dim", 128),
        n_group=get(hf, "n_group", None) or get(hf, "num_expert_group", 1),
        topk_group=get(hf, "topk_group", 1),
        routed_scaling_factor=float(get(hf, "routed_scaling_factor", 1.0)),
        n_shared_experts=get(hf, "n_shared_experts", None) or get(hf, "num_shared_experts", 1),
        num_mtp_layers=get(hf, "num_mtp_layers", None) or get(hf, "num_nextn_predict_layers", 0),
    )




def one_layout(name: str, size: int, *shape) -> list:
    """The layout of a parameter that is exactly one Hugging Face tensor (split along dim 0 when sharded)."""
    return [layout((size, *shape), 0, [(name, size)])]


def carried_state(pool, meta):
    """The state each prefill sequence starts from: its slot's, when tokens precede its chunk, else zeros."""
    idx = meta.state_indices.long()
    q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
    carry = (meta.seq_lens > q_lens).view(-1, *[1] * (pool.dim() - 1))
    return idx, torch.where(carry, pool.index_select(0, idx), torch.zeros((), dtype=pool.dtype, device=pool.device))


# ---- KDA -----------------------------------------------------------------------------------------------------------


class ShortConv(nn.Module):
    """Depthwise causal conv kernels ``[C, 1, W]`` (no bias); column-sharded with the q|k|v channels under TP."""

    fp32_params = ("weight",)
    tp_style: str | None = None
    tp_group = None

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))


class ForgetGate(nn.Module):
    """``A_log [H]`` and ``dt_bias [H*D]`` of the per-channel log-decay (fp32; split by heads under TP)."""

    fp32_params = ("A_log", "dt_bias")
    tp_style: str | None = None
    tp_group = None

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads * head_dim))


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: BailingHybridConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        h, hd = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.qkv_proj = Linear(h, 3 * hd)
        self.conv = ShortConv(3 * hd, cfg.conv_kernel)
        self.f_proj = Linear(h, hd)
        self.decay = ForgetGate(cfg.num_heads, cfg.head_dim)
        self.b_proj = Linear(h, cfg.num_heads)
        self.g_proj = Linear(h, hd)
        self.o_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_proj = Linear(hd, h)
        self.safe_gate, self.lower_bound = cfg.kda_safe_gate, cfg.kda_lower_bound

    def shard_heads(self, rank: int, size: int) -> None:
        self.num_heads //= size

    def log_decay(self, x):
        """fp32 ``[T, H, D]`` per-channel log forget gate."""
        t, hh, d = x.shape[0], self.num_heads, self.head_dim
        gate_in = self.f_proj(x).float().view(t, hh, d) + self.decay.dt_bias.view(hh, d)
        rate = self.decay.A_log.exp().view(hh, 1)
        if self.safe_gate:
            return self.lower_bound * torch.sigmoid(rate * gate_in)
        return -rate * F.softplus(gate_in)

    def forward(self, x, positions, rope, meta, kv_cache=None):
        t, hh, d = x.shape[0], self.num_heads, self.head_dim
        mixed, w, cu = self.qkv_proj(x), self.conv.weight.squeeze(1), meta.cu_seqlens_q
        decode = kv_cache is not None and not meta.is_prefill
        if kv_cache is None:
            qkv, _ = causal_conv1d(mixed, w, activation="silu", cu_seqlens=cu)
        elif decode:
            qkv = causal_conv1d_update(mixed, kv_cache[0], w, activation="silu", state_indices=meta.state_indices)
        else:
            idx, s0 = carried_state(kv_cache[0], meta)
            qkv, final = causal_conv1d(mixed, w, activation="silu", cu_seqlens=cu, initial_state=s0,
                                       output_final_state=True)
            kv_cache[0].index_copy_(0, idx, final)
        q, k, v = qkv.to(x.dtype).view(t, 3, hh, d).unbind(1)
        q, k = _l2norm(q).to(x.dtype), _l2norm(k).to(x.dtype)  # normalised in fp32, as the reference does
        g = self.log_decay(x).to(x.dtype).float()
        beta = torch.sigmoid(self.b_proj(x)).float()
        # q/k/v in the model dtype (bf16 tensor-core matmuls on a GPU), gates fp32; the state is fp32 inside
        if kv_cache is None:
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=d**-0.5, cu_seqlens=cu)
        elif decode:
            o = fused_recurrent_gated_delta_rule_step(q, k, v, g, beta, kv_cache[1], scale=d**-0.5,
                                                      state_indices=meta.state_indices)
        else:
            idx, s0 = carried_state(kv_cache[1], meta)
            o, final = chunk_gated_delta_rule(q, k, v, g, beta, scale=d**-0.5, cu_seqlens=cu, initial_state=s0,
                                              output_final_state=True)
            kv_cache[1].index_copy_(0, idx, final)
        gate = self.g_proj(x).view(t, hh, d)
        return self.o_proj(_gated_rms_norm(o.to(x.dtype), gate, self.o_norm).reshape(t, hh * d))

    def layouts(self, name: str, hf: str, cfg: BailingHybridConfig) -> dict:
        h, hh, d, w = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.conv_kernel
        hd = hh * d
        return {
            f"{name}.qkv_proj.weight": [layout((3 * hd, h), 0, [(f"{hf}.{p}_proj.weight", hd) for p in "qkv"])],
            f"{name}.conv.weight": [layout((3 * hd, 1, w), 0, [(f"{hf}.{p}_conv1d.weight", hd) for p in "qkv"])],
            f"{name}.f_proj.weight": one_layout(f"{hf}.f_proj.weight", hd, h),
            f"{name}.decay.A_log": one_layout(f"{hf}.A_log", hh),
            f"{name}.decay.dt_bias": one_layout(f"{hf}.dt_bias", hd),
            f"{name}.b_proj.weight": one_layout(f"{hf}.b_proj.weight", hh, h),
            f"{name}.g_proj.weight": one_layout(f"{hf}.g_proj.weight", hd, h),
            f"{name}.o_norm.weight": one_layout(f"{hf}.o_norm.weight", d),
            f"{name}.o_proj.weight": [layout((h, hd), 1, [(f"{hf}.dense.weight", hd)])],
        }


def _l2norm(x, eps: float = 1e-6):
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _gated_rms_norm(o, gate, norm: RMSNorm):
    """``rmsnorm(o) * w * sigmoid(gate)`` over the head dim, in fp32, cast back to o's dtype."""
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (norm.weight.float() * of * torch.sigmoid(gate.float())).to(o.dtype)


# ---- MLA -----------------------------------------------------------------------------------------------------------


def _rope_interleaved(x, positions, rope):
    """DeepSeek's interleaved-pair RoPE of ``x [T, H, r]``, output de-interleaved as transformers returns it."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), positions, *rope)


class LatentAttention(nn.Module):
    def __init__(self, cfg: BailingHybridConfig, attn_backend: str = "flash"):
        super().__init__()
        h, hh = cfg.hidden_size, cfg.num_heads
        self.num_heads = hh
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.q_rank = cfg.kv_lora_rank, cfg.q_lora_rank
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
        self.g_proj = Linear(h, hh)
        self.o_proj = Linear(hh * self.v_dim, h, bias=cfg.attention_bias)
        self.scale = qk**-0.5
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
        k_rot = copy_to_tp(_rope_interleaved(k_rot.view(t, 1, r), positions, rope), self.kv_b_proj.tp_group)
        q = torch.cat([q[..., :nope], _rope_interleaved(q[..., nope:], positions, rope)], dim=-1)
        latent_cache = kv_cache is not None and len(kv_cache) == 1  # else (k_cache, v_cache) expanded per head
        if latent_cache:  # the new tokens' rows first: decode and a cached prefix read them from the cache
            store_latent(torch.cat([latent, k_rot.view(t, r)], dim=-1), kv_cache[0], meta.slot_mapping)
            if not meta.is_prefill:
                return self._output(self._decode_absorbed(q, kv_cache[0], meta), x)
            if meta.has_prefix:  # every key of each sequence, expanded from its cached rows
                latent, k_rot = _cached_rows(kv_cache[0], meta).split([self.rank, r], dim=-1)
                k_rot = k_rot.unsqueeze(1)
        kv = self.kv_b_proj(latent).view(-1, hh, nope + self.v_dim)
        k_nope, v = kv.split([nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, hh, r)], dim=-1)
        width = max(nope + r, self.v_dim)
        q, k, v = (F.pad(z, (0, width - z.shape[-1])) if z.shape[-1] < width else z for z in (q, k, v))
        if kv_cache is not None and not latent_cache:
            store_kvcache(k, v, *kv_cache, meta.slot_mapping)
        if kv_cache is not None and not latent_cache and (not meta.is_prefill or meta.has_prefix):
            multi = dict(cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q) if meta.is_prefill else {}
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
                           kv_lora_rank=self.rank, softmax_scale=self.scale)
        return torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)

    def _output(self, o, x):
        """The head-wise sigmoid gate, then the output projection of ``o [T, H, d_v]``."""
        t = x.shape[0]
        gate = torch.sigmoid(self.g_proj(x).float()).to(x.dtype)
        return self.o_proj((o * gate.unsqueeze(-1)).reshape(t, self.num_heads * self.v_dim))

    def layouts(self, name: str, hf: str, cfg: BailingHybridConfig) -> dict:
        h, hh, r, qk = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        kva, hv = r + cfg.qk_rope_head_dim, hh * cfg.v_head_dim
        out = {
            f"{name}.kv_a_proj.weight": one_layout(f"{hf}.kv_a_proj_with_mqa.weight", kva, h),
            f"{name}.kv_a_layernorm.weight": one_layout(f"{hf}.kv_a_layernorm.weight", r),
            f"{name}.kv_b_proj.weight": one_layout(f"{hf}.kv_b_proj.weight", hh * cfg.qk_nope_head_dim + hv, r),
            f"{name}.g_proj.weight": one_layout(f"{hf}.g_proj.weight", hh, h),
            f"{name}.o_proj.weight": [layout((h, hv), 1, [(f"{hf}.dense.weight", hv)])],
        }
        if cfg.q_lora_rank is None:
            out[f"{name}.q_proj.weight"] = one_layout(f"{hf}.q_proj.weight", hh * qk, h)
        else:
            q = cfg.q_lora_rank
            out[f"{name}.q_a_proj.weight"] = one_layout(f"{hf}.q_a_proj.weight", q, h)
            out[f"{name}.q_a_layernorm.weight"] = one_layout(f"{hf}.q_a_layernorm.weight", q)
            out[f"{name}.q_b_proj.weight"] = one_layout(f"{hf}.q_b_proj.weight", hh * qk, q)
        if cfg.attention_bias:
            out[f"{name}.kv_a_proj.bias"] = one_layout(f"{hf}.kv_a_proj_with_mqa.bias", kva)
            out[f"{name}.o_proj.bias"] = one_layout(f"{hf}.dense.bias", h)
            if cfg.q_lora_rank is not None:
                out[f"{name}.q_a_proj.bias"] = one_layout(f"{hf}.q_a_proj.bias", cfg.q_lora_rank)
        return out


def _cached_rows(cache, meta):
    """The latent-cache rows ``[sum(seq_lens), r + d_rope]`` of every token of each sequence, in order (packed as
    ``cu_seqlens_k``); prefill only (one host read for the total)."""
    lens, bs = meta.seq_lens.long(), cache.shape[1]
    cu = meta.cu_seqlens_k.long()
    total = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
    j = torch.arange(total, device=lens.device) - cu[seq]
    return cache[meta.block_table[seq, j // bs].long(), j % bs]


# ---- MoE -----------------------------------------------------------------------------------------------------------


class Router(nn.Module):
    """``weight [E, H]`` (scores = sigmoid(x W^T) in fp32) and the selection-only ``expert_bias [E]``, both fp32,
    replicated under TP. The bias is not trained by the optimizer: ``update_routing_bias`` moves it."""

    fp32_params = ("weight", "expert_bias")

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.expert_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)


class SigmoidMoE(nn.Module):
    """Routed experts (``fused_moe``) plus the shared expert; routing counts ``expert_load`` (see qwen3_moe)."""

    has_router = True

    def __init__(self, cfg: BailingHybridConfig):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.register_buffer("expert_load", None, persistent=False)

    def init_buffers(self, device) -> None:
        self.expert_load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)

    def route(self, x, given=None):
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids, counts = route_sigmoid_grouped_topk(
            logits, self.top_k, bias=self.gate.expert_bias, n_group=self.n_group, topk_group=self.topk_group,
            routed_scaling_factor=self.scaling, renormalize=self.renormalize,
        )  # fmt: skip
        if given is not None:  # routing replay: the given experts, weighted by the current router
            ids, counts = replay_routes(ids, given, self.num_experts)
        if given is not None or (torch.is_grad_enabled() and logits.requires_grad):
            # the kernel's weights carry no autograd graph: recompute them from the chosen ids (T x k, cheap)
            weights = torch.sigmoid(logits).gather(1, ids.long())
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * self.scaling
        if self.training and torch.is_grad_enabled() and self.expert_load is not None:
            self.expert_load += counts
        return weights, ids

    def compute(self, x, weights, ids):
        group = self.experts.tp_group
        xs, weights = copy_to_tp(x, group), copy_to_tp(weights, group)
        routed = reduce_from_tp(fused_moe(xs, self.experts.w13, self.experts.w2, weights, ids), group)
        return routed + self.shared_experts(x)

    def forward(self, x):
        return self.compute(x, *self.route(x))

    def layouts(self, name: str, hf: str, cfg: BailingHybridConfig) -> dict:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        exp = f"{hf}.experts"
        out = {
            f"{name}.gate.weight": one_layout(f"{hf}.gate.weight", e, h),
            f"{name}.gate.expert_bias": one_layout(f"{hf}.gate.expert_bias", e),
            f"{name}.experts.w13": [
                layout((e, 2 * i, h), 0, [(f"{exp}.{j}.gate_proj.weight", i), (f"{exp}.{j}.up_proj.weight", i)], j)
                for j in range(e)
            ],
            f"{name}.experts.w2": [layout((e, h, i), 1, [(f"{exp}.{j}.down_proj.weight", i)], j) for j in range(e)],
        }
        out.update(self.shared_experts.layouts(f"{name}.shared_experts", f"{hf}.shared_experts", cfg))
        return out
