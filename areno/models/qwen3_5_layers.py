"""Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``) building blocks: the config, zero-centred RMSNorm, gated attention, the
gated delta net and the MoE block with a gated shared expert.

A pre-norm decoder whose token mixer follows ``layer_types`` (default: every ``full_attention_interval``-th layer
full attention, the others linear attention):

- every RMSNorm of the decoder (input/post-attention/final norms, per-head q/k norms) is zero-centred: it scales by
  ``1 + weight`` (computed in fp32); the gated delta net's output norm scales by ``weight`` (the plain kind).
- ``full_attention``: GQA with per-head q/k norm and partial NeoX RoPE (``partial_rotary_factor``: the first
  ``rotary_dim`` dims of a head rotate); ``q_proj`` emits per head ``[q | gate]`` (2 x head_dim rows), and the
  attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``. Text positions put the same index on every
  M-RoPE stream, so the interleaved ``mrope_section`` layout reduces to plain RoPE for text.
- ``linear_attention`` (Gated DeltaNet), ``nk`` key heads of ``dk`` and ``nv`` value heads of ``dv``:
  [q | k | v] = silu(causal depthwise conv_W(x W_qkv)) (one short conv over the 2 nk dk + nv dv channels),
  q, k l2-normalised per head (``x * rsqrt(sum x^2 + 1e-6)``, fp32) and repeated to ``nv`` heads (each key head
  serves ``nv / nk`` consecutive value heads), beta = sigmoid(x W_b), the scalar per-head log-decay
  g = -exp(A_log) * softplus(x W_a + dt_bias); the gated delta rule (``chunk_gated_delta_rule`` with g ``[T, H]``,
  scale ``dk^-1/2``); out = out_proj(rmsnorm_dv(o) * w * silu(x W_z)).
  The four input projections ``in_proj_{qkv,z,b,a}`` run as one GEMM (``in_proj``).
- MLP: dense SwiGLU, or (``qwen3_5_moe``) softmax top-k routed experts, always renormalised, plus a shared expert
  scaled by ``sigmoid(x W_shared_gate)``.

The text model (``Qwen35ForCausalLM``: engine sizes, Hub layouts, the kept MTP tensors) is at the end; the
registration and the checkpoint formats are in ``qwen3_5.py``, the vision-language model in ``qwen3_5_vl.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from areno.kernels.linear_attn.gdn_decode import (
    gated_rms_norm_silu,
    gdn_decode_step,
    gdn_inputs,
    gdn_verify_steps,
)
from areno.models import bailing_hybrid_layers
from areno.models.base import MLP, Attention, CausalLM, DecoderLayer
from areno.models.layers import Linear, RMSNorm
from areno.models.linear_state import delta_rule, short_conv
from areno.models.model_config import ModelConfig, dense_config, get
from areno.models.mtp import KeptMTP, block_layouts, mtp_layer_indices
from areno.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoE
from areno.models.tp import layout, one_layout

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen35Config(ModelConfig):
    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    conv_kernel: int = 4
    shared_expert_intermediate_size: int = 0
    hf_prefix: str = "model."  # "model.language_model." in the composite (vision-language) checkpoints

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0


def check_qwen3_5(raw: dict) -> None:
    """Refuse a composite ``qwen3_5``/``qwen3_5_moe`` config.json without its ``text_config``."""
    if raw.get("model_type") in ("qwen3_5", "qwen3_5_moe") and not isinstance(raw.get("text_config"), dict):
        raise ValueError(f"{raw.get('model_type')}: config.json has no text_config (the decoder's settings)")


def qwen3_5_config(hf) -> Qwen35Config:
    """The decoder's config from a text config (``qwen3_5_text``/``qwen3_5_moe_text``) or a composite one."""
    model_type = get(hf, "model_type")
    text, prefix = get(hf, "text_config", None), "model.language_model."
    if text is None:
        text, prefix = hf, "model."
    name = model_type.removesuffix("_text")
    tie = get(hf, "tie_word_embeddings", None) if text is not hf else None
    moe = name == "qwen3_5_moe"
    experts = get(text, "num_experts", 0) if moe else 0
    shared = get(text, "shared_expert_intermediate_size", 0) if moe else 0
    base = dense_config(text, model_type, qk_norm=True, intermediate_size=shared or get(text, "intermediate_size"),
                        tie_word_embeddings=bool(get(text, "tie_word_embeddings", False) if tie is None else tie))
    _refuse(name, text, base)
    n = base.num_layers
    interval = get(text, "full_attention_interval", 4)
    layer_types = list(get(text, "layer_types", None) or
                       ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)])
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad or len(layer_types) != n:
        raise NotImplementedError(f"{name}: layer_types must list {n} of {LAYER_TYPES}, got {layer_types}")
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    fields.update(num_experts=experts, norm_topk_prob=True)
    if moe:
        fields.update(num_experts_per_tok=get(text, "num_experts_per_tok"),
                      moe_intermediate_size=get(text, "moe_intermediate_size"))
    return Qwen35Config(
        **fields, layer_types=layer_types, hf_prefix=prefix,
        linear_num_key_heads=get(text, "linear_num_key_heads", 16),
        linear_num_value_heads=get(text, "linear_num_value_heads", 32),
        linear_key_head_dim=get(text, "linear_key_head_dim", 128),
        linear_value_head_dim=get(text, "linear_value_head_dim", 128),
        conv_kernel=get(text, "linear_conv_kernel_dim", 4),
        shared_expert_intermediate_size=shared,
    )  # fmt: skip


def _refuse(name: str, text, base: ModelConfig) -> None:
    """One line naming each config option the adapter does not implement."""
    if base.rope_scaling is not None:
        raise NotImplementedError(f"{name}: rope_type {base.rope_scaling.get('rope_type')!r} is not supported "
                                  "(default is)")
    if base.attention_bias:
        raise NotImplementedError(f"{name}: attention_bias=true is not supported")
    if get(text, "attn_output_gate", True) is False:
        raise NotImplementedError(f"{name}: attn_output_gate=false is not supported (the gated attention is)")
    nk, nv = get(text, "linear_num_key_heads", 16), get(text, "linear_num_value_heads", 32)
    if nv % nk:
        raise NotImplementedError(f"{name}: linear_num_value_heads={nv} must be a multiple of "
                                  f"linear_num_key_heads={nk}")
    if name == "qwen3_5_moe" and get(text, "norm_topk_prob", True) is False:
        raise NotImplementedError(f"{name}: norm_topk_prob=false is not supported (transformers always "
                                  "renormalises the top-k weights)")


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + weight``, rounded as transformers does: ``(n * (1 + w)).to(dtype)`` with ``n`` and
    the product in fp32 (rounding ``n`` to bf16 first, as the plain RMSNorm does, doubles the bf16 logit error); the
    residual sum rounded to the input dtype first (as transformers adds it). One kernel with the residual add
    (``rms_norm(zero_centered=True)``); it keeps ``x + residual`` in the input dtype for the backward, not in fp32."""

    zero_centered = True

    def scale(self) -> torch.Tensor:
        return 1.0 + self.weight.float()


class GatedAttention(Attention):
    """Attention whose ``q_proj`` also emits a per-head output gate (fused here with k and v into ``qkv_proj``)."""

    def __init__(self, cfg: Qwen35Config, attn_backend: str = "flash"):
        super().__init__(cfg, attn_backend)
        d = cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * d)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)

    def qk_norm_weights(self, dtype):
        return self.q_norm.scale().to(dtype), self.k_norm.scale().to(dtype)

    def forward(self, x, positions, rope, meta, kv_cache=None):
        t, d, hq = x.shape[0], self.head_dim, self.num_heads
        y = self.qkv_proj(x)
        qg = y[:, : 2 * hq * d].view(t, hq, 2 * d)
        qkv = torch.cat([qg[..., :d].reshape(t, hq * d), y[:, 2 * hq * d:]], dim=-1)
        q, k, v = self.prologue(qkv, positions, rope, meta, kv_cache)
        o = self.attend(q, k, v, meta, kv_cache).reshape(t, hq * d)
        return self.o_proj(o * torch.sigmoid(qg[..., d:].reshape(t, hq * d)))

    def layouts(self, name: str, hf: str, cfg: Qwen35Config) -> dict:
        h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        parts = [(f"{hf}.q_proj.weight", 2 * hq * d, "plain", 2 * d)]
        parts += [(f"{hf}.{p}_proj.weight", hkv * d, "kv", d) for p in "kv"]
        out = {f"{name}.qkv_proj.weight": [layout(((2 * hq + 2 * hkv) * d, h), 0, parts)],
               f"{name}.o_proj.weight": [layout((h, hq * d), 1, [(f"{hf}.o_proj.weight", hq * d)])]}
        for p in "qk":
            out[f"{name}.{p}_norm.weight"] = one_layout(f"{hf}.{p}_norm.weight", d)
        return out


class ShortConv(bailing_hybrid_layers.ShortConv):
    """Ling 3's conv kernels ``[C, 1, W]`` (split by heads under TP), in the model dtype as transformers keeps them."""

    fp32_params = ()


class Decay(nn.Module):
    """``A_log [nv]`` and ``dt_bias [nv]`` of the per-head log-decay (split by value heads under TP)."""

    tp_style: str | None = None
    tp_group = None

    def __init__(self, heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer (equations in the module docstring). In the engine its cache entry is the
    pair of per-sequence state pools ``(conv [S, C, W-1], recurrent [S, nv, dk, dv])`` (see bailing_hybrid). Under
    TP each rank holds ``nk / tp`` key heads and ``nv / tp`` value heads: every projection row, conv channel and
    decay parameter of its heads, and the rows of ``out_proj`` (row parallel)."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        h, kd, vd = cfg.hidden_size, self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * kd + vd
        self.in_proj = Linear(h, self.conv_dim + vd + 2 * self.nv)
        self.in_proj.fp8_kept_parts = 2  # b and a, a scalar per value head: FP8 rollout keeps them (vLLM's in_proj_ba)
        self.conv = ShortConv(self.conv_dim, cfg.conv_kernel)
        self.decay = Decay(self.nv)
        self.norm = RMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(vd, h)

    def shard_heads(self, rank: int, size: int) -> None:
        if self.nk % size:
            raise ValueError(f"--tp-size {size} does not divide linear_num_key_heads={self.nk} (qwen3_5 splits the "
                             "gated delta net by heads)")
        self.nk, self.nv = self.nk // size, self.nv // size
        self.conv_dim = 2 * self.nk * self.dk + self.nv * self.dv

    def forward(self, x, positions, rope, meta, kv_cache=None):
        t, nk, nv, dk, dv = x.shape[0], self.nk, self.nv, self.dk, self.dv
        vd = nv * dv
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, vd, nv, nv], dim=-1)
        qkv = short_conv(mixed, self.conv.weight.squeeze(1), meta, kv_cache)
        if kv_cache is not None and not meta.is_prefill:  # one kernel from the conv output to the recurrence's
            qkv, n = qkv.to(x.dtype), meta.tokens_per_seq  # (gdn_decode); n > 1: a speculative verify's n tokens a
            kw = dict(num_k_heads=nk, num_v_heads=nv, scale=dk**-0.5, state_indices=meta.state_indices)  # sequence
            if n == 1:
                o = gdn_decode_step(qkv, a, b, self.decay.A_log, self.decay.dt_bias, kv_cache[1], **kw)
            else:  # in one kernel; a speculative step's leaves the states to its rollback's replay (its inputs kept)
                keep = None if meta.state_steps is None else meta.state_steps.next("recurrent")
                o = gdn_verify_steps(qkv, a, b, self.decay.A_log, self.decay.dt_bias, kv_cache[1], n=n, keep=keep,
                                     **kw)  # fmt: skip
            o = gated_rms_norm_silu(o, z.reshape(t, nv, dv), self.norm.weight, self.norm.eps)
            return self.out_proj(o.reshape(t, vd))
        q, k, v, g, beta = gdn_inputs(qkv.to(x.dtype), a, b, self.decay.A_log, self.decay.dt_bias, num_k_heads=nk,
                                      num_v_heads=nv, head_k_dim=dk)
        o = delta_rule(q, k, v, g, beta, dk**-0.5, meta, kv_cache)
        o = gated_rms_norm_silu(o.to(x.dtype).contiguous(), z.reshape(t, nv, dv), self.norm.weight, self.norm.eps)
        return self.out_proj(o.reshape(t, vd))

    def layouts(self, name: str, hf: str, cfg: Qwen35Config) -> dict:
        h, nk, nv, dk, dv = (cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                             cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        kd, vd, w = nk * dk, nv * dv, cfg.conv_kernel
        c = 2 * kd + vd

        def qkv(tensor):  # q, k and v rows of one Hub tensor, each split by heads under TP
            return [(tensor, kd, "plain", dk, 0, c), (tensor, kd, "plain", dk, kd, c),
                    (tensor, vd, "plain", dv, 2 * kd, c)]

        parts = qkv(f"{hf}.in_proj_qkv.weight") + [(f"{hf}.in_proj_z.weight", vd), (f"{hf}.in_proj_b.weight", nv),
                                                  (f"{hf}.in_proj_a.weight", nv)]
        return {
            f"{name}.in_proj.weight": [layout((c + vd + 2 * nv, h), 0, parts)],
            f"{name}.conv.weight": [layout((c, 1, w), 0, qkv(f"{hf}.conv1d.weight"))],
            f"{name}.decay.A_log": one_layout(f"{hf}.A_log", nv),
            f"{name}.decay.dt_bias": one_layout(f"{hf}.dt_bias", nv),
            f"{name}.norm.weight": one_layout(f"{hf}.norm.weight", dv),
            f"{name}.out_proj.weight": [layout((h, vd), 1, [(f"{hf}.out_proj.weight", vd)])],
        }


class SharedExpertMoE(SparseMoE):
    """Qwen3-MoE's routed experts (softmax top-k, renormalised) plus ``sigmoid(x W_g) * shared_expert(x)``."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__(cfg)
        self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def compute(self, x, weights, ids):
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().compute(x, weights, ids) + shared

    def layouts(self, name: str, hf: str, cfg: Qwen35Config) -> dict:
        out = super().layouts(name, hf, cfg)
        out.update(self.shared_expert.layouts(f"{name}.shared_expert", f"{hf}.shared_expert", cfg))
        out[f"{name}.shared_expert_gate.weight"] = one_layout(f"{hf}.shared_expert_gate.weight", 1, cfg.hidden_size)
        return out


# ---- the text model -------------------------------------------------------------------------------------------------


KEPT_PREFIXES = ("mtp.", "model.visual.")


class Qwen35DecoderLayer(DecoderLayer):
    """The pre-norm block with zero-centred norms."""

    def __init__(self, cfg: Qwen35Config, mlp, attn_backend: str = "flash", attn=None):
        super().__init__(cfg, mlp, attn_backend, attn)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(KeptMTP, Qwen3MoeForCausalLM):
    layer_class = Qwen35DecoderLayer

    def __init__(self, cfg: Qwen35Config, *, attn_backend: str = "flash"):
        def attn(cfg, i):
            return GatedAttention(cfg, attn_backend) if cfg.layer_types[i] == "full_attention" else GatedDeltaNet(cfg)

        CausalLM.__init__(self, cfg, attn_backend=attn_backend, attn_factory=attn,
                          mlp_factory=lambda cfg, i: SharedExpertMoE(cfg) if cfg.num_experts else MLP(cfg))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.init_mtp()

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
        (nv, dk, dv)}``; the conv state in the model dtype, the recurrent state fp32 (or --mamba-ssm-cache-dtype's)."""
        linear = [i for i, t in enumerate(self.config.layer_types) if t == "linear_attention"]
        if not linear:
            return None
        mixer = self.layers[linear[0]].self_attn
        return {"layers": linear, "conv": (mixer.conv_dim, self.config.conv_kernel - 1),
                "recurrent": (mixer.nv, mixer.dk, mixer.dv)}

    # ---- the MTP draft (areno.models.mtp) -------------------------------------------------------------------------
    mtp_layer_prefix = "mtp.layers."

    def mtp_draft_parts(self) -> dict:
        """Qwen3.5's MTP: zero-centred pre-fc norms, ``fc`` and final ``norm`` shared by its ``mtp.layers.{j}``
        full-attention blocks (MoE like the decoder's in the MoE family); the chained hidden state is the normed one."""
        cfg, h = self.config, self.config.hidden_size
        backend = self.attn_backend
        blocks = [Qwen35DecoderLayer(cfg, SharedExpertMoE(cfg) if cfg.num_experts else MLP(cfg), backend,
                                     GatedAttention(cfg, backend))
                  for _ in mtp_layer_indices(self.mtp_names, self.mtp_layer_prefix)]
        layouts = {"enorm.0.weight": one_layout("mtp.pre_fc_norm_embedding.weight", h),
                   "hnorm.0.weight": one_layout("mtp.pre_fc_norm_hidden.weight", h),
                   "proj.0.weight": one_layout("mtp.fc.weight", h, 2 * h),
                   "norm.0.weight": one_layout("mtp.norm.weight", h)}
        for j, block in enumerate(blocks):
            layouts.update(block_layouts(block, f"blocks.{j}", f"mtp.layers.{j}", cfg))
        norm = lambda: [ZeroCenteredRMSNorm(h, cfg.rms_norm_eps)]  # noqa: E731
        return dict(enorm=norm(), hnorm=norm(), proj=[Linear(2 * h, h)], norm=norm(), blocks=blocks, layouts=layouts,
                    chain_normed=True)

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
        out.update(self.mtp_layouts())
        return out
