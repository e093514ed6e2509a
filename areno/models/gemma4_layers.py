"""Gemma 4's decoder pieces: attention with its own head dim / KV heads per layer and KV sharing, the GeGLU MLP, the
MoE block (router on the normed residual, per-expert scales), the sandwich-norm decoder layer with its per-layer
input (PLE) and layer scalar, and the soft-capped log-probs.

Attention (per layer i): ``qkv_proj`` holds q, k and v (k only when ``attention_k_eq_v`` makes v the raw k, on the
full layers), or q alone on a KV-shared layer, which reads the K/V of an earlier layer of its type (``kv_source``):
in training the producer hands its (k, v) to the later layers; in the engine those layers read the producer's
paged cache and write none. q and k get a per-head RMSNorm (weight, not ``1 + weight``), v one without a scale;
the attention scale is 1. Norms are ``weight * x / rms(x)`` everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from areno.kernels.activation import gelu_tanh_and_mul
from areno.kernels.attention import attention
from areno.kernels.attention.paged import paged_attention, paged_kv, store_kvcache
from areno.kernels.norm import rms_norm
from areno.kernels.rope import apply_rope
from areno.models.base import MLP, DecoderLayer
from areno.models.layers import Linear, RMSNorm, vocab_parallel_logits
from areno.models.model_config import ModelConfig
from areno.models.qwen3_moe import Experts, SparseMoE
from areno.models.tp import copy_to_tp, layout, reduce_from_tp


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, attn_backend: str = "flash"):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.layer_kv_heads[i], cfg.layer_head_dims[i]
        d = self.head_dim
        self.shared = cfg.kv_source[i] != i  # reads an earlier layer's K/V
        self.k_eq_v = cfg.k_eq_v and cfg.layer_types[i] == "full_attention" and not self.shared
        kv_rows = 0 if self.shared else (1 if self.k_eq_v else 2) * self.num_kv_heads * d
        self.qkv_proj = Linear(h, self.num_heads * d + kv_rows)
        self.o_proj = Linear(self.num_heads * d, h)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = None if self.shared else RMSNorm(d, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps
        self.backend = "native" if attn_backend == "native" else None
        self.window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
        self.register_buffer("v_scale", None, persistent=False)  # ones: v's RMSNorm has no weight

    def init_buffers(self, device) -> None:
        dtype = self.o_proj.nf4_dtype or self.o_proj.weight.dtype  # an NF4 o_proj's without dequantising it
        self.v_scale = torch.ones(self.head_dim, dtype=dtype, device=device)

    def shard_heads(self, rank: int, size: int) -> None:
        """Local head counts under TP: query heads split, this layer's KV heads split or replicated."""
        if self.num_heads % size or (self.num_kv_heads % size and size % self.num_kv_heads):
            raise ValueError(f"--tp-size {size} must divide num_attention_heads={self.num_heads} and divide or be "
                             f"divided by this layer's {self.num_kv_heads} KV heads (head dim {self.head_dim})")
        self.num_heads //= size
        self.num_kv_heads = max(1, self.num_kv_heads // size)

    def forward(self, x, positions, rope, meta, kv_cache=None, shared_kv=None):
        """``(out [T, H], (k, v))``: the K/V this layer attended to (its own, or ``shared_kv``)."""
        t, d, hq = x.shape[0], self.head_dim, self.num_heads
        qkv = self.qkv_proj(x)
        q = apply_rope(self.q_norm(qkv[:, : hq * d].reshape(t, hq, d)), positions, *rope)
        if self.shared:
            k, v = shared_kv
        else:
            kv = qkv[:, hq * d :].reshape(t, -1, d)
            k, v = (kv, kv) if self.k_eq_v else kv.chunk(2, dim=1)
            v = rms_norm(v, self.v_scale, self.eps)
            k = apply_rope(self.k_norm(k), positions, *rope)
            if kv_cache is not None:  # an FP8 cache (paged_kv): quantised on write, dequantised by the kernel
                k_cache, v_cache, scales = paged_kv(kv_cache)
                store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        if kv_cache is not None and (not meta.is_prefill or meta.has_prefix):
            k_cache, v_cache, scales = paged_kv(kv_cache)
            o = paged_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, softmax_scale=1.0, window=self.window, **scales,
                **({"cu_seqlens_q": meta.cu_seqlens_q, "max_seqlen_q": meta.max_seqlen_q} if meta.is_prefill
                   else {"split_rows": meta.split_rows}),
            )  # fmt: skip
        else:
            o = attention(
                q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
                causal=True, softmax_scale=1.0, backend=self.backend, window=self.window,
            )  # fmt: skip
        return self.o_proj(o.reshape(t, -1)), (k, v)

    def layouts(self, name: str, hf: str, cfg: ModelConfig) -> dict:
        h, d, hq, hkv = cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        parts = [(f"{hf}.q_proj.weight", hq * d, "plain", d)]
        if not self.shared:
            parts += [(f"{hf}.{p}_proj.weight", hkv * d, "kv", d) for p in ("k" if self.k_eq_v else "kv")]
        rows = sum(p[1] for p in parts)
        out = {f"{name}.qkv_proj.weight": [layout((rows, h), 0, parts)],
               f"{name}.o_proj.weight": [layout((h, hq * d), 1, [(f"{hf}.o_proj.weight", hq * d)])]}
        for p in ("q" if self.shared else "qk"):
            out[f"{name}.{p}_norm.weight"] = [layout((d,), 0, [(f"{hf}.{p}_norm.weight", d)])]
        return out


class Gemma4MLP(MLP):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def compute(self, x):
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma4Router(nn.Module):
    """Expert logits of ``proj(rms_norm(x) * scale / sqrt(H))``; the chosen weights get ``per_expert_scale``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(cfg.hidden_size))
        self.proj = Linear(cfg.hidden_size, cfg.num_experts)
        self.per_expert_scale = nn.Parameter(torch.empty(cfg.num_experts))
        self.eps, self.root = cfg.rms_norm_eps, cfg.hidden_size**-0.5

    def forward(self, x):
        return self.proj(rms_norm(x, self.scale, self.eps) * self.root)


class Gemma4MoE(SparseMoE):
    """Softmax top-k routed GeGLU experts (renormalised, then times the expert's scale), run beside the dense MLP."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, True
        self.gate = Gemma4Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.register_buffer("expert_load", None, persistent=False)

    def route(self, x, given=None):
        weights, ids = super().route(x, given)
        return weights * self.gate.per_expert_scale[ids.long()].float(), ids

    def compute(self, x, weights, ids):
        group = self.experts.tp_group
        x, weights = copy_to_tp(x, group), copy_to_tp(weights, group)
        out = self.experts.routed(x, weights, ids, activation="gelu_tanh")
        return reduce_from_tp(out, group)

    def layouts(self, name: str, hf: str, cfg: ModelConfig) -> dict:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        return {
            f"{name}.gate.proj.weight": [layout((e, h), 0, [(f"{hf}.router.proj.weight", e)])],
            f"{name}.gate.scale": [layout((h,), 0, [(f"{hf}.router.scale", h)])],
            f"{name}.gate.per_expert_scale": [layout((e,), 0, [(f"{hf}.router.per_expert_scale", e)])],
            f"{name}.experts.w13": [layout((e, 2 * i, h), 0, [(f"{hf}.experts.gate_up_proj", e)])],
            f"{name}.experts.w2": [layout((e, h, i), 0, [(f"{hf}.experts.down_proj", e)])],
        }


NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
MOE_NORMS = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")
PLE_NORMS = ("post_per_layer_input_norm",)


class Gemma4DecoderLayer(DecoderLayer):
    """``h += post_attn_norm(attn(in_norm(h)))``; ``h += post_ff_norm(mlp(pre_ff_norm(h)) [+ moe])``; the PLE
    block ``h += norm(proj(gelu(gate(h)) * ple_i))``; ``h *= layer_scalar``. With activation checkpointing the
    attention half and the feed-forward half are recomputed apart; routing runs once between them."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module, attn_backend: str = "flash", attn: nn.Module | None = None):
        nn.Module.__init__(self)
        self.self_attn, self.mlp, self.checkpointing = attn, mlp, False
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.moe = Gemma4MoE(cfg) if cfg.num_experts else None
        self.ple_dim = cfg.ple_dim
        if self.ple_dim:
            self.per_layer_input_gate = Linear(h, self.ple_dim)
            self.per_layer_projection = Linear(self.ple_dim, h)
        for norm in NORMS + (MOE_NORMS if self.moe else ()) + (PLE_NORMS if self.ple_dim else ()):
            setattr(self, norm, RMSNorm(h, eps))
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)  # a checkpoint buffer: kept frozen

    def attn_half(self, h, positions, rope, meta, kv_cache=None, shared_kv=None):
        a, kv = self.self_attn(self.input_layernorm(h), positions, rope, meta, kv_cache, shared_kv)
        return h + self.post_attention_layernorm(a), *kv

    def ffn_half(self, h, ple, *route):
        x, h_in = self.pre_feedforward_layernorm(h), h
        m = self.mlp.compute(x)
        if self.moe is not None:
            moe = self.moe.compute(self.pre_feedforward_layernorm_2(h), *route)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(moe)
        h = h_in + self.post_feedforward_layernorm(m)
        if self.ple_dim:
            g = self.per_layer_projection(F.gelu(self.per_layer_input_gate(h), approximate="tanh") * ple)
            h = h + self.post_per_layer_input_norm(g)
        return h * self.layer_scalar

    def routed_block(self):
        return self.moe

    def forward(self, h, ple, positions, rope, meta, kv_cache=None, shared_kv=None):
        """``(h, (k, v))`` (see ``Gemma4Attention.forward``)."""
        recompute = self.checkpointing and kv_cache is None and torch.is_grad_enabled()
        if recompute:
            h, k, v = checkpoint(self.attn_half, h, positions, rope, meta, None, shared_kv, use_reentrant=False)
            route = self.route(h, meta)
            return checkpoint(self.ffn_half, h, ple, *route, use_reentrant=False), (k, v)
        h, k, v = self.attn_half(h, positions, rope, meta, kv_cache, shared_kv)
        return self.ffn_half(h, ple, *self.route(h, meta)), (k, v)

    def layouts(self, name: str, hf: str, cfg: ModelConfig) -> dict:
        h, p = cfg.hidden_size, self.ple_dim
        out = self.self_attn.layouts(f"{name}.self_attn", f"{hf}.self_attn", cfg)
        out.update(self.mlp.layouts(f"{name}.mlp", f"{hf}.mlp", cfg))
        if self.moe is not None:
            out.update(self.moe.layouts(f"{name}.moe", hf, cfg))
        for norm in NORMS + (MOE_NORMS if self.moe else ()) + (PLE_NORMS if p else ()):
            out[f"{name}.{norm}.weight"] = [layout((h,), 0, [(f"{hf}.{norm}.weight", h)])]
        if p:
            out[f"{name}.per_layer_input_gate.weight"] = [layout((p, h), 0, [(f"{hf}.per_layer_input_gate.weight", p)])]
            out[f"{name}.per_layer_projection.weight"] = [layout((h, p), 0, [(f"{hf}.per_layer_projection.weight", h)])]
        out[f"{name}.layer_scalar"] = [layout((1,), 0, [(f"{hf}.layer_scalar", 1)])]
        return out


def softcapped_logprobs(hidden, weight, targets, cap: float, *, temperature=1.0, return_entropy=False,
                        chunk_size=None, tp_group=None):
    """fp32 ``log softmax(cap * tanh(hidden @ weight.T / cap) / temperature)[targets]`` (``-100`` -> 0), and the
    entropy with ``return_entropy``; plain PyTorch ops over row chunks, each recomputed in backward (no ``[T, V]``
    kept). The logits come from a GEMM in the weights' dtype (no fused soft-capping log-prob kernel yet); under TP
    ``weight`` is this rank's vocab shard and the logits are gathered."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat = targets.reshape(-1)
    step = chunk_size or max(1, 2**26 // max(1, weight.shape[0]))
    lps, ents = [], []
    for s in range(0, rows.shape[0], step):
        args = (rows[s : s + step], weight, flat[s : s + step], cap, temperature, tp_group)
        lp, ent = checkpoint(_capped_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else \
            _capped_chunk(*args)  # fmt: skip
        lps.append(lp)
        ents.append(ent)
    lp, ent = torch.cat(lps).reshape(targets.shape), torch.cat(ents).reshape(targets.shape)
    return (lp, ent) if return_entropy else lp


def _capped_chunk(h, weight, targets, cap, temperature, tp_group):
    logits = vocab_parallel_logits(h, weight, tp_group).float()
    logp = torch.log_softmax(torch.tanh(logits / cap) * (cap / temperature), dim=-1)
    lp = logp.gather(-1, targets.clamp(min=0).long().unsqueeze(-1)).squeeze(-1)
    return torch.where(targets < 0, torch.zeros_like(lp), lp), -(logp.exp() * logp).sum(-1)
