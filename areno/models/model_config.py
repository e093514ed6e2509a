"""The normalised architecture description every adapter builds from a Hugging Face config.

Adapters translate their family's config (optional fields defaulted the way ``transformers`` does) into this
dataclass; the shared decoder in ``base.py`` reads only these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areno.kernels.rope import rope_params_from_config


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rotary_dim: int = 0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # sliding-window attention (OLMo 3): these layers see only the last ``sliding_window`` keys
    sliding_window: int | None = None
    sliding_layers: list[int] = field(default_factory=list)
    sliding_rope: tuple[float, dict | None] | None = None  # (theta, scaling) of those layers when it differs
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # the recurrent state's dtype a hybrid checkpoint asks for (config.json "mamba_ssm_dtype"; --mamba-ssm-cache-dtype
    # auto follows it)
    mamba_ssm_dtype: str | None = None

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % max(1, self.decoder_sparse_step) == 0
        )


def get(hf, key, default=None):
    value = hf.get(key, default) if isinstance(hf, dict) else getattr(hf, key, default)
    return default if value is None else value


def decoder_fields(hf, model_type: str) -> dict:
    """The ``ModelConfig`` fields every decoder reads the same way (sizes, norm eps, tied head, biases), from a
    transformers config object (or dict); a non-SiLU activation is refused."""
    act = get(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise NotImplementedError(f"{model_type}: hidden_act {act!r} is not supported (silu is)")
    heads = get(hf, "num_attention_heads")
    return dict(
        model_type=model_type,
        vocab_size=get(hf, "vocab_size"),
        hidden_size=get(hf, "hidden_size"),
        intermediate_size=get(hf, "intermediate_size"),
        num_layers=get(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=get(hf, "num_key_value_heads", heads),
        rms_norm_eps=get(hf, "rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(get(hf, "tie_word_embeddings", False)),
        attention_bias=bool(get(hf, "attention_bias", False)),
        mamba_ssm_dtype=get(hf, "mamba_ssm_dtype", None),
    )


def dense_config(hf, model_type: str, **overrides) -> ModelConfig:
    """The fields shared by Llama-like decoders, read from a transformers config object (or dict)."""
    fields = decoder_fields(hf, model_type)
    base, scaling, rotary_dim = rope_params_from_config(hf)
    fields.update(
        head_dim=get(hf, "head_dim", None) or fields["hidden_size"] // fields["num_heads"],
        rope_theta=base,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        max_position_embeddings=get(hf, "max_position_embeddings", 4096),
        mlp_bias=bool(get(hf, "mlp_bias", False)),
    )
    fields.update(overrides)
    return ModelConfig(**fields)
