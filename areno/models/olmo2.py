"""OLMo 2: a Llama-like GQA decoder with post-norms inside the residual and an RMSNorm over the whole q / k projection.

Each layer is ``h = h + post_attention_layernorm(attn(h))`` then ``h = h + post_feedforward_layernorm(mlp(h))`` (no
input norm); the final ``model.norm`` is as in Llama. The QK-norm spans all heads (``num_heads * head_dim`` and
``num_kv_heads * head_dim`` wide): under TP each rank holds its heads' slice of the norm weight and the per-token sum
of squares is all-reduced over the group (forward and backward). TP wider than the KV heads (replicated KV heads) is
refused at load in one line.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from areno.models.base import Attention, CausalLM, DecoderLayer
from areno.models.layers import RMSNorm
from areno.models.model_config import ModelConfig, dense_config, get
from areno.models.registry import ModelCard, register
from areno.models.tp import copy_to_tp, layout, reduce_from_tp


def olmo2_config(hf) -> ModelConfig:
    dropout = float(get(hf, "attention_dropout", 0.0))
    if dropout != 0.0:
        raise NotImplementedError(f"olmo2: attention_dropout={dropout} is not supported (0.0 is)")
    if get(hf, "mlp_bias", False):
        raise NotImplementedError("olmo2: mlp_bias=true is not supported (transformers' Olmo2MLP has no bias)")
    return dense_config(hf, "olmo2")


class ProjectionNorm(RMSNorm):
    """RMSNorm over a projection split by heads under TP: this rank's columns, the mean square of all of them."""

    fp8_act_source = False  # its output feeds attention, not a projection

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.full_dim = dim

    def forward(self, x):
        if self.tp_group is None:
            return super().forward(x)
        xf = x.float()
        square_sum = xf.square().sum(-1, keepdim=True)  # all-reduce forward and backward: every shard uses the sum
        square_sum = reduce_from_tp(copy_to_tp(square_sum, self.tp_group), self.tp_group)
        return (self.weight * (xf * torch.rsqrt(square_sum / self.full_dim + self.eps))).to(x.dtype)


class Olmo2Attention(Attention):
    """GQA attention whose q and k projections are RMS-normed over their full width before RoPE."""

    def __init__(self, cfg: ModelConfig, attn_backend: str = "flash"):
        super().__init__(cfg, attn_backend)
        self.q_proj_norm = ProjectionNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_proj_norm = ProjectionNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)

    def shard_heads(self, rank: int, size: int) -> None:
        if size > self.num_kv_heads:
            raise ValueError(
                f"--tp-size {size}: olmo2 needs the TP size to divide num_key_value_heads="
                f"{self.num_kv_heads} (its k norm spans the KV heads, which cannot be replicated)"
            )
        super().shard_heads(rank, size)

    def project_qkv(self, x):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        return torch.cat([self.q_proj_norm(q.contiguous()), self.k_proj_norm(k.contiguous()), v], dim=-1)

    def layouts(self, name: str, hf: str, cfg: ModelConfig) -> dict:
        out = super().layouts(name, hf, cfg)
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        out[f"{name}.q_proj_norm.weight"] = [layout((hq * d,), 0, [(f"{hf}.q_norm.weight", hq * d, "plain", d)])]
        out[f"{name}.k_proj_norm.weight"] = [layout((hkv * d,), 0, [(f"{hf}.k_norm.weight", hkv * d, "kv", d)])]
        return out


class Olmo2DecoderLayer(DecoderLayer):
    """Post-norm block. It returns ``(norm(mlp(x)), x)``: the next layer (or the final norm) adds the two."""

    def __init__(self, cfg: ModelConfig, mlp, attn_backend: str = "flash", attn=None):
        super().__init__(cfg, mlp, attn_backend, attn)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def block(self, h, residual, positions, rope, meta, kv_cache=None):
        x = h if residual is None else h + residual
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, rope, meta, kv_cache))
        return self.post_feedforward_layernorm(self.mlp.compute(x)), x

    def forward(self, h, residual, positions, rope, meta, kv_cache=None):
        if self.checkpointing and kv_cache is None and torch.is_grad_enabled():
            return checkpoint(self.block, h, residual, positions, rope, meta, use_reentrant=False)
        return self.block(h, residual, positions, rope, meta, kv_cache)


class Olmo2ForCausalLM(CausalLM):
    layer_class = Olmo2DecoderLayer
    attention_class = Olmo2Attention  # OLMo 3: with its per-layer window and RoPE

    def __init__(self, cfg: ModelConfig, *, attn_backend: str = "flash"):
        super().__init__(cfg, attn_backend=attn_backend,
                         attn_factory=lambda cfg, i: self.attention_class(cfg, attn_backend))

    def hf_layouts(self) -> dict:
        out = super().hf_layouts()
        h = self.config.hidden_size
        for i in range(self.config.num_layers):
            name, hf = f"layers.{i}", f"model.layers.{i}"
            del out[f"{name}.input_layernorm.weight"]
            norm = "post_feedforward_layernorm"
            out[f"{name}.{norm}.weight"] = [layout((h,), 0, [(f"{hf}.{norm}.weight", h)])]
        return out


register("olmo2", olmo2_config, Olmo2ForCausalLM,
         card=ModelCard("OLMo 2", tp="must divide the KV heads",
                        notes="post-norm layers, QK-norm over the whole q/k projection"))
