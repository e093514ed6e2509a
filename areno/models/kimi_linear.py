"""Kimi-Linear (``model_type: kimi_linear``, ``KimiLinearForCausalLM``, e.g. Kimi-Linear-48B-A3B): a pre-norm decoder
of Kimi Delta Attention (KDA, linear attention) and MLA layers by ``layer_types`` (the Hub config lists them 1-indexed
in ``linear_attn_config.kda_layers`` / ``full_attn_layers``), dense SwiGLU for the ``first_k_dense_replace`` layers,
then the sigmoid-routed MoE with shared experts (``moe_layers.py``). Built on Ling 3's pieces (``bailing_hybrid``):
the same KDA module and kernels (``kernels/linear_attn``: short conv, chunked / recurrent gated delta rule, the
engine's per-sequence conv and recurrent state slots), the same MLA module and engine caches, the same MoE.

Where it differs from Ling 3:

- KDA: its own head count and head dim (``linear_attn_config.num_heads`` / ``head_dim``, not the MLA's); the forget
  and output-gate projections are low rank (``f_b(f_a(x))``, ``g_b(g_a(x))`` through the head dim); the forget gate
  is always ``-exp(A_log) * softplus(x W_f + dt_bias)`` (no safe gate, no lower bound), ``A_log`` stored
  ``[1, 1, H, 1]``; only ``dt_bias`` is kept fp32 (conv kernels and ``A_log`` in the model dtype, as transformers
  keeps them).
- MLA: no position encoding at all (NoPE: the ``qk_rope_head_dim`` part of q and of the shared key is not rotated),
  no output gate, the output projection named ``o_proj``; the softmax scale ``(d_nope + d_rope)**-0.5``.
- MoE: under ``block_sparse_moe`` on the Hub (``gate.weight``, ``gate.e_score_correction_bias``, experts' ``w1``
  (gate), ``w3`` (up), ``w2`` (down), ``shared_experts``); the dense MLPs under ``mlp``. No MTP layers.
- Names: Llama's (``model.embed_tokens``, ``layers.i.self_attn``), never tied embeddings.

Refused at load (one line naming the option): ``mla_use_nope: false`` (RoPE in the MLA layers),
``moe_router_activation_func`` other than sigmoid, ``moe_layer_freq != 1``, ``use_grouped_topk: false`` with expert
groups, an activation other than silu,
``num_key_value_heads != num_attention_heads``, layer types other than KDA / MLA.
"""

from __future__ import annotations

from areno.models.bailing_hybrid import BailingHybridForCausalLM
from areno.models.bailing_hybrid_layers import BailingHybridConfig, ForgetGate, KimiDeltaAttention, ShortConv
from areno.models.deepseek_v3 import mla_fields
from areno.models.layers import Linear
from areno.models.model_config import get
from areno.models.registry import ModelCard, register
from areno.models.tp import layout, one_layout

LAYER_TYPES = ("linear_attention", "full_attention")


def check_kimi_linear(raw: dict) -> None:
    """Refuse a ``kimi_linear`` config.json naming an option the adapter does not implement (one line)."""
    if raw.get("quantization_config"):
        raise ValueError("kimi_linear: quantization_config (quantized weights) is not supported; use bf16 weights")
    refusals = (("mla_use_nope", True), ("moe_router_activation_func", "sigmoid"), ("moe_layer_freq", 1))
    for key, supported in refusals:
        if raw.get(key, supported) != supported:
            raise ValueError(f"kimi_linear: {key}={raw[key]!r} is not supported ({supported!r} is)")
    if raw.get("use_grouped_topk") is False and (raw.get("num_expert_group") or raw.get("n_group") or 1) > 1:
        raise ValueError("kimi_linear: use_grouped_topk=false with num_expert_group > 1 is not supported (areno "
                         "routes group-limited whenever there are groups)")
    unknown = sorted(set(raw.get("layer_types") or []) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"kimi_linear: layer_types {unknown} are not supported (linear_attention = KDA, "
                         "full_attention = MLA)")


def _layer_types(hf, n: int) -> tuple[list[str], list[str]]:
    """(token mixer, MLP) type per layer: transformers' config object has both; a raw config.json may only have
    ``linear_attn_config`` (1-indexed layer lists) and ``first_k_dense_replace``."""
    types = get(hf, "layer_types", None)
    lin = get(hf, "linear_attn_config", None) or {}
    if not types and "full_attn_layers" in lin:
        full = {i - 1 for i in lin["full_attn_layers"]}
        types = ["full_attention" if i in full else "linear_attention" for i in range(n)]
    if not types:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    mlp = get(hf, "mlp_layer_types", None)
    if not mlp:
        dense_k = get(hf, "first_k_dense_replace", 1)
        mlp = ["dense" if i < dense_k else "sparse" for i in range(n)]
    return list(types), list(mlp)


def kimi_linear_config(hf) -> BailingHybridConfig:
    if isinstance(hf, dict):
        check_kimi_linear(hf)
    fields = mla_fields(hf, "kimi_linear")
    layer_types, mlp_types = _layer_types(hf, fields["num_layers"])
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"kimi_linear: layer_types {unknown} are not supported")
    lin = get(hf, "linear_attn_config", None) or {}
    experts = get(hf, "num_local_experts", None) or get(hf, "num_experts")
    fields.update(
        n_group=get(hf, "n_group", None) or get(hf, "num_expert_group", 1),
        num_experts_per_tok=get(hf, "num_experts_per_tok", None) or get(hf, "num_experts_per_token", 8),
        n_shared_experts=get(hf, "n_shared_experts", None) or get(hf, "num_shared_experts", 1),
        norm_topk_prob=bool(get(hf, "norm_topk_prob", get(hf, "moe_renormalize", True))),
        rotary_dim=2,  # NoPE: no RoPE table is read (a minimal one, not 1M positions of qk_rope_head_dim)
    )
    return BailingHybridConfig(
        **fields,
        head_dim=get(hf, "linear_head_dim", None) or lin.get("head_dim", 128),
        linear_num_heads=get(hf, "linear_num_heads", None) or lin.get("num_heads", 32),
        conv_kernel=get(hf, "linear_conv_kernel_dim", None) or lin.get("short_conv_kernel_size", 4),
        kda_safe_gate=False,
        max_position_embeddings=get(hf, "model_max_length", None) or get(hf, "max_position_embeddings", 4096),
        num_experts=experts,
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        mla_rope="none",
        hf_expert_names=("w1", "w3", "w2"),
    )


class KimiShortConv(ShortConv):
    fp32_params = ()  # the conv kernels stay in the model dtype (transformers keeps only dt_bias fp32)


class KimiForgetGate(ForgetGate):
    fp32_params = ("dt_bias",)


class KimiLinearDeltaAttention(KimiDeltaAttention):
    """KDA with low-rank forget and output-gate projections (rank = the head dim)."""

    hf_o_proj = "o_proj"

    def __init__(self, cfg: BailingHybridConfig):
        super().__init__(cfg)
        heads, d = cfg.linear_num_heads, cfg.head_dim
        self.conv = KimiShortConv(3 * heads * d, cfg.conv_kernel)
        self.decay = KimiForgetGate(heads, d, a_log_shape=(1, 1, heads, 1))

    def make_gate_projections(self, h: int, hd: int) -> None:
        d = hd // self.num_heads
        self.f_a_proj, self.f_b_proj = Linear(h, d), Linear(d, hd)
        self.g_a_proj, self.g_b_proj = Linear(h, d), Linear(d, hd)

    def forget_input(self, x):
        return self.f_b_proj(self.f_a_proj(x))

    def gate_input(self, x):
        return self.g_b_proj(self.g_a_proj(x))

    def gate_layouts(self, name: str, hf: str, h: int, hh: int, d: int) -> dict:
        out = {f"{name}.decay.A_log": [layout((1, 1, hh, 1), 2, [(f"{hf}.A_log", hh)])]}
        for g in "fg":
            out[f"{name}.{g}_a_proj.weight"] = one_layout(f"{hf}.{g}_a_proj.weight", d, h)
            out[f"{name}.{g}_b_proj.weight"] = one_layout(f"{hf}.{g}_b_proj.weight", hh * d, d)
        return out


class KimiLinearForCausalLM(BailingHybridForCausalLM):
    delta_attention = KimiLinearDeltaAttention
    hf_embed, hf_attn = "model.embed_tokens.weight", "self_attn"

    def keep_hf_tensor(self, hf_name: str) -> bool:
        return False  # no MTP layers

    def hf_mlp(self, i: int) -> str:
        return "block_sparse_moe" if self.config.is_moe_layer(i) else "mlp"


register("kimi_linear", kimi_linear_config, KimiLinearForCausalLM, check_config=check_kimi_linear,
         card=ModelCard("Kimi-Linear", ("hybrid", "moe"), routing_replay=True,
                        notes="KDA linear attention (low-rank gates) + NoPE MLA, sigmoid-routed MoE; Ling 3's kernels"))
