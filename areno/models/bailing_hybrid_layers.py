"""Ling / Bailing V3 (``bailing_hybrid``) building blocks: the config and the KDA token mixer (also Kimi-Linear's).

A pre-norm decoder whose token mixer alternates by ``layer_types``:

- ``linear_attention``: Kimi Delta Attention (KDA). Per head h with ``D = head_dim`` (the config's KDA head dim):
  q, k, v = silu(causal depthwise conv_W(x W_{q,k,v}))   (one short conv over the concatenated q|k|v channels)
  q, k <- l2-normalised (x / sqrt(sum x^2 + 1e-6)),  beta = sigmoid(x W_b) [H]
  g = kda_lower_bound * sigmoid(exp(A_log) * (x W_f + dt_bias))  per channel, log-decay in [lower_bound, 0]
      (``kda_safe_gate=false``: g = -exp(A_log) * softplus(x W_f + dt_bias))
  S_t = diag(exp g_t) S_{t-1};  S_t += k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = S_t^T q_t / sqrt(D)
  out = o_proj(rmsnorm_D(o) * w_o * sigmoid(x W_g))   (the gated RMSNorm, fp32)
- ``full_attention`` (every ``layer_group_size``-th layer): multi-head latent attention (``mla.py``) with a
  head-wise output gate and DeepSeek's interleaved RoPE.
- MLP: dense SwiGLU for the ``first_k_dense_replace`` layers, then the sigmoid-routed MoE of ``moe_layers.py`` (the
  per-expert fp32 bias is ``expert_bias`` on the Hub) with one always-on shared expert.

The model (engine sizes, MoE balancing, MTP tensors, Hub layouts) is ``bailing_hybrid.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from areno.models.layers import Linear, RMSNorm
from areno.models.linear_state import delta_rule, short_conv
from areno.models.mla import MLAConfig
from areno.models.model_config import get
from areno.models.tp import layout, one_layout

ARCHITECTURES = ("BailingMoeV3ForCausalLM", "BailingHybridForCausalLM")


@dataclass
class BailingHybridConfig(MLAConfig):
    """``MLAConfig`` plus the KDA layers' fields (also Kimi-Linear's, see kimi_linear.py)."""

    layer_types: list[str] = field(default_factory=list)  # "linear_attention" (KDA) | "full_attention" (MLA)
    conv_kernel: int = 4
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    linear_num_heads: int = 0  # KDA heads (0: num_heads); the KDA head dim is head_dim


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
        mamba_ssm_dtype=get(hf, "mamba_ssm_dtype", None),
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
        mla_output_gate=True,
        hf_o_proj="dense",
        hf_router_bias="expert_bias",
    )


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
    """``A_log [H]`` (Kimi-Linear: ``[1, 1, H, 1]``) and ``dt_bias [H*D]`` of the per-channel log-decay (fp32; split
    by heads under TP)."""

    fp32_params = ("A_log", "dt_bias")
    tp_style: str | None = None
    tp_group = None

    def __init__(self, heads: int, head_dim: int, a_log_shape: tuple[int, ...] | None = None):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(a_log_shape or (heads,)))
        self.dt_bias = nn.Parameter(torch.empty(heads * head_dim))


class KimiDeltaAttention(nn.Module):
    """KDA with full-rank forget and output-gate projections (Ling 3); Kimi-Linear's low-rank ones subclass it."""

    hf_o_proj = "dense"  # the Hub name of the output projection

    def __init__(self, cfg: BailingHybridConfig):
        super().__init__()
        heads = cfg.linear_num_heads or cfg.num_heads
        self.num_heads, self.head_dim = heads, cfg.head_dim
        h, hd = cfg.hidden_size, heads * cfg.head_dim
        self.qkv_proj = Linear(h, 3 * hd)
        self.conv = ShortConv(3 * hd, cfg.conv_kernel)
        self.make_gate_projections(h, hd)
        self.decay = ForgetGate(heads, cfg.head_dim)
        self.b_proj = Linear(h, heads)
        self.o_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_proj = Linear(hd, h)
        self.safe_gate, self.lower_bound = cfg.kda_safe_gate, cfg.kda_lower_bound

    def make_gate_projections(self, h: int, hd: int) -> None:
        self.f_proj = Linear(h, hd)
        self.g_proj = Linear(h, hd)

    def forget_input(self, x):
        """``x W_f [T, H*D]`` (before ``dt_bias``)."""
        return self.f_proj(x)

    def gate_input(self, x):
        """``x W_g [T, H*D]``: the output gate's pre-activation."""
        return self.g_proj(x)

    def shard_heads(self, rank: int, size: int) -> None:
        self.num_heads //= size

    def log_decay(self, x):
        """fp32 ``[T, H, D]`` per-channel log forget gate."""
        t, hh, d = x.shape[0], self.num_heads, self.head_dim
        gate_in = self.forget_input(x).float().view(t, hh, d) + self.decay.dt_bias.view(hh, d)
        rate = self.decay.A_log.exp().view(hh, 1)
        if self.safe_gate:
            return self.lower_bound * torch.sigmoid(rate * gate_in)
        return -rate * F.softplus(gate_in)

    def forward(self, x, positions, rope, meta, kv_cache=None):
        t, hh, d = x.shape[0], self.num_heads, self.head_dim
        qkv = short_conv(self.qkv_proj(x), self.conv.weight.squeeze(1), meta, kv_cache)
        q, k, v = qkv.to(x.dtype).view(t, 3, hh, d).unbind(1)
        q, k = l2norm(q).to(x.dtype), l2norm(k).to(x.dtype)  # normalised in fp32, as the reference does
        g = self.log_decay(x).to(x.dtype).float()
        beta = torch.sigmoid(self.b_proj(x)).float()
        # q/k/v in the model dtype (bf16 tensor-core matmuls on a GPU), gates fp32; the state is fp32 inside
        o = delta_rule(q, k, v, g, beta, d**-0.5, meta, kv_cache)
        gate = self.gate_input(x).view(t, hh, d)
        return self.o_proj(gated_rms_norm(o.to(x.dtype), gate, self.o_norm).reshape(t, hh * d))

    def layouts(self, name: str, hf: str, cfg: BailingHybridConfig) -> dict:
        h, hh, d, w = cfg.hidden_size, cfg.linear_num_heads or cfg.num_heads, cfg.head_dim, cfg.conv_kernel
        hd = hh * d
        out = {
            f"{name}.qkv_proj.weight": [layout((3 * hd, h), 0, [(f"{hf}.{p}_proj.weight", hd) for p in "qkv"])],
            f"{name}.conv.weight": [layout((3 * hd, 1, w), 0, [(f"{hf}.{p}_conv1d.weight", hd) for p in "qkv"])],
            f"{name}.decay.dt_bias": one_layout(f"{hf}.dt_bias", hd),
            f"{name}.b_proj.weight": one_layout(f"{hf}.b_proj.weight", hh, h),
            f"{name}.o_norm.weight": one_layout(f"{hf}.o_norm.weight", d),
            f"{name}.o_proj.weight": [layout((h, hd), 1, [(f"{hf}.{self.hf_o_proj}.weight", hd)])],
        }
        out.update(self.gate_layouts(name, hf, h, hh, d))
        return out

    def gate_layouts(self, name: str, hf: str, h: int, hh: int, d: int) -> dict:
        """The layouts of the forget / output-gate projections and ``A_log``."""
        return {
            f"{name}.f_proj.weight": one_layout(f"{hf}.f_proj.weight", hh * d, h),
            f"{name}.g_proj.weight": one_layout(f"{hf}.g_proj.weight", hh * d, h),
            f"{name}.decay.A_log": one_layout(f"{hf}.A_log", hh),
        }


def l2norm(x, eps: float = 1e-6):
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_rms_norm(o, gate, norm: RMSNorm):
    """``rmsnorm(o) * w * sigmoid(gate)`` over the head dim, in fp32, cast back to o's dtype."""
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (norm.weight.float() * of * torch.sigmoid(gate.float())).to(o.dtype)
