"""GPT-OSS (``gpt_oss``): a pre-norm GQA MoE decoder with attention sinks, sliding windows on alternate layers and
YaRN RoPE (layers in ``gpt_oss_layers``).

``config.layer_types`` names each layer ``sliding_attention`` (the last ``sliding_window`` keys, as OLMo 3:
``self_attn.window``) or ``full_attention``; every layer is MoE (``num_local_experts``, ``num_experts_per_tok``,
experts of ``intermediate_size``, ``swiglu_alpha`` / ``swiglu_limit``). Options the adapter does not implement are
refused at load in one line: a quantization other than the Hub's MXFP4 experts, attention dropout, unknown layer
types. MXFP4 checkpoints (``quantization_config.quant_method == "mxfp4"``: ``*_blocks`` / ``*_scales`` experts) are
dequantized at load (``mxfp4.py``) into the model dtype, as transformers' ``Mxfp4Config(dequantize=True)`` does; the
model then is a plain one, and saves as a dequantized checkpoint (``quantization_config`` dropped from config.json).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from areno.kernels.rope import rope_inv_freq
from areno.models.base import CausalLM
from areno.models.gpt_oss_layers import GptOssAttention, GptOssMoE
from areno.models.model_config import ModelConfig, dense_config, get
from areno.models.mxfp4 import Mxfp4Source
from areno.models.qwen3_moe import Qwen3MoeForCausalLM
from areno.models.registry import ModelCard, register

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GptOssModelConfig(ModelConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False  # the checkpoint's experts are MXFP4 blocks/scales, dequantized at load


def _refuse(raw: dict) -> None:
    """One-line refusals of the options the adapter does not implement."""
    method = (get(raw, "quantization_config", None) or {}).get("quant_method", None)
    if method not in (None, "mxfp4"):
        raise NotImplementedError(f"gpt_oss: quantization_config with quant_method={method!r} is not supported (mxfp4 "
                                  "is, dequantized at load); load a dequantized (bf16) checkpoint")
    dropout = float(get(raw, "attention_dropout", 0.0))
    if dropout != 0.0:
        raise NotImplementedError(f"gpt_oss: attention_dropout={dropout} is not supported (0.0 is)")


def gpt_oss_config(hf) -> GptOssModelConfig:
    raw = dict(hf) if isinstance(hf, dict) else hf.to_dict()
    _refuse(raw)
    n = get(raw, "num_hidden_layers")
    layer_types = list(get(raw, "layer_types", None) or
                       ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    if set(layer_types) - set(LAYER_TYPES) or len(layer_types) != n:
        raise NotImplementedError(f"gpt_oss: layer_types must list {n} of {LAYER_TYPES}, got {layer_types}")
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    window = get(raw, "sliding_window", None)
    if sliding and (not isinstance(window, int) or window < 1):
        raise NotImplementedError(f"gpt_oss: sliding_window={window!r} must be a positive int for the sliding layers")
    experts, top_k = get(raw, "num_local_experts", None) or get(raw, "num_experts"), get(raw, "num_experts_per_tok")
    if not (isinstance(experts, int) and isinstance(top_k, int) and 1 <= top_k <= experts):
        raise NotImplementedError(f"gpt_oss: num_experts_per_tok={top_k!r} must be in [1, num_local_experts="
                                  f"{experts!r}]")
    # the experts run the clamped SwiGLU whatever hidden_act says (transformers' GptOssExperts ignores it too)
    cfg = dense_config({**raw, "hidden_act": "silu"}, "gpt_oss", attention_bias=bool(get(raw, "attention_bias", True)),
                       num_experts=experts, num_experts_per_tok=top_k,
                       moe_intermediate_size=get(raw, "intermediate_size"), norm_topk_prob=True)
    try:
        rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise NotImplementedError(f"gpt_oss: rope_parameters {cfg.rope_scaling}: {e}") from None
    cfg.sliding_window, cfg.sliding_layers = (window, sliding) if sliding else (None, [])
    return GptOssModelConfig(**asdict(cfg), swiglu_alpha=float(get(raw, "swiglu_alpha", 1.702)),
                             swiglu_limit=float(get(raw, "swiglu_limit", 7.0)),
                             mxfp4=(get(raw, "quantization_config", None) or {}).get("quant_method") == "mxfp4")


class GptOssForCausalLM(Qwen3MoeForCausalLM):
    _hf_config: dict | None = None

    def __init__(self, cfg: GptOssModelConfig, *, attn_backend: str = "flash"):
        CausalLM.__init__(self, cfg, attn_backend=attn_backend, mlp_factory=lambda cfg, i: GptOssMoE(cfg),
                          attn_factory=lambda cfg, i: GptOssAttention(cfg, attn_backend))
        for i in cfg.sliding_layers:
            self.layers[i].self_attn.window = cfg.sliding_window

    def checkpoint_source(self, source):
        return Mxfp4Source(source) if self.config.mxfp4 else source

    @property
    def hf_config(self) -> dict | None:
        return self._hf_config

    @hf_config.setter
    def hf_config(self, raw: dict | None) -> None:
        """Loaded MXFP4 experts are dequantized: the config saved with the model says so by having no quantization."""
        self._hf_config = None if raw is None else {k: v for k, v in raw.items() if k != "quantization_config"}


register("gpt_oss", gpt_oss_config, GptOssForCausalLM,
         card=ModelCard("GPT-OSS", ("moe",), routing_replay=True,
                        notes="attention sinks, sliding windows on alternate layers, "
                              "YaRN, biased experts with the clamped SwiGLU on areno's grouped GEMMs; MXFP4 "
                              "checkpoints dequantized at load"))
