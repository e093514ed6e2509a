"""Tiny random Hugging Face checkpoints (qwen3, qwen3_moe, llama, bailing_hybrid, olmo2, olmo3, gpt_oss,
deepseek_v3, kimi_linear, qwen3_5, gemma4_text, gemma4) for tests and demos; nothing is downloaded.

``make_tiny_checkpoint(path, family, seed, **overrides)`` writes the layout a Hub checkpoint has: ``config.json``
(through the transformers config class, so ``AutoConfig`` reads it), ``model.safetensors`` (random weights under HF's
own tensor names, byte-identical for the same seed), ``generation_config.json`` and the tiny tokenizer's files
(``areno.testing.tokenizer``: byte-level BPE, ChatML template with tools).

Version notes, so areno's loaders and the tests agree on every transformers version:
- transformers 5 writes rope settings as ``rope_parameters`` (with ``rope_theta`` inside) and the qwen3_moe expert
  count as ``num_local_experts``; 4.x writes ``rope_theta``/``rope_scaling`` and ``num_experts``. ``config.json``
  carries both spellings (the legacy ones are what Hub checkpoints hold), which every version reads the same way.
- qwen3_moe experts are stored per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``) as on the Hub;
  transformers 5 fuses them into ``gate_up_proj``/``down_proj`` at load and splits them back at save.
- bailing_hybrid (Ling 3) uses the Hub's tensor names (``model.word_embeddings``, ``layers.i.attention.*`` with
  ``dense``/``q_conv1d``/..., ``mlp.gate.expert_bias``, per-expert weights), which transformers renames at load, and
  stores ``num_mtp_layers`` MTP layers after the decoder (``enorm``/``hnorm``/``eh_proj``, an MLA + MoE block,
  ``final_layernorm``) that transformers skips. The tensors transformers keeps fp32 (router, expert bias, conv
  kernels, ``dt_bias``, ``A_log``) are written fp32 whatever ``dtype`` is.
- The weights are drawn by tensor name with a seeded CPU generator, independent of transformers, so the bytes are the
  same whichever version is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import areno.testing.tokenizer as tiny_tokenizer
from areno.testing import qwen3_5
from areno.testing.gemma4 import ONE_LIKE, gemma4_config, gemma4_defaults, gemma4_shapes
from areno.testing.qwen3_vl import make_tiny_vl_checkpoint
from areno.testing.shapes import weight_shapes

FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "bailing_hybrid": ("BailingHybridConfig", "BailingMoeV3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    **qwen3_5.FAMILIES,
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration"),
}
BAILING_FP32 = ("mlp.gate.weight", "expert_bias", "_conv1d.weight", "dt_bias", "A_log")
FP32_TENSORS = {  # the tensors transformers keeps fp32 in any dtype (_keep_in_fp32_modules_strict), per family
    "bailing_hybrid": BAILING_FP32,
    "deepseek_v3": ("mlp.gate.weight", "e_score_correction_bias"),
    "kimi_linear": ("block_sparse_moe.gate.weight", "e_score_correction_bias", "dt_bias"),
}
# Init std, written to config.json as initializer_range. Larger than HF's 0.02 on purpose: at 0.02 the residual
# stream is all embedding, and the tied qwen3 model predicts its own input token 98% of the time, so generation tests
# could not see a position or KV-cache bug. At 0.1 the layers matter (changing the first token changes ~80% of the
# later argmaxes) and the next-token distribution stays broad (entropy 6.6 nats of 6.9) for sampling tests.
WEIGHT_STD = 0.1
NORM_NOISE_STD = 0.05
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _defaults(family: str) -> dict:
    bos = tiny_tokenizer.token_id(tiny_tokenizer.BOS_TOKEN)
    eos = tiny_tokenizer.token_id(tiny_tokenizer.EOS_TOKEN)
    pad = tiny_tokenizer.token_id(tiny_tokenizer.PAD_TOKEN)
    cfg = dict(
        vocab_size=tiny_tokenizer.VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=WEIGHT_STD,
        use_cache=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    if family == "qwen3":
        cfg.update(tie_word_embeddings=True, use_sliding_window=False, sliding_window=None)
    elif family == "qwen3_moe":
        cfg.update(
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=None,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            output_router_logits=False,
        )
    elif family == "llama":
        cfg.update(tie_word_embeddings=False, mlp_bias=False, rope_scaling=dict(LLAMA3_ROPE_SCALING))
    elif family == "olmo2":  # untied like the Hub checkpoints
        cfg.update(tie_word_embeddings=False)
    elif family == "olmo3":  # a window shorter than the test sequences, a sliding layer then a full one
        # (a legacy rope_theta would set the full layers' RoPE only: give both layer types the same one)
        rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        cfg.update(tie_word_embeddings=False, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": dict(rope), "full_attention": dict(rope)})
    elif family == "gemma4_text":
        gemma4_defaults(cfg)
    elif family == "bailing_hybrid":
        # [KDA, MLA, KDA, MLA], dense MLP first then 8 experts in 4 groups; qk head dim 24 != v head dim 16
        cfg.update(
            tie_word_embeddings=False, num_hidden_layers=4, num_key_value_heads=4, rope_theta=6e6,
            layer_group_size=2, first_k_dense_replace=1, short_conv_kernel_size=4, kda_safe_gate=True,
            kda_lower_bound=-5.0, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_mtp_layers=1,
        )
    elif family == "gpt_oss":  # a sliding layer then a full one, YaRN, a SwiGLU limit the tiny weights reach
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 256}
        cfg.pop("rope_theta")
        cfg.update(tie_word_embeddings=False, attention_bias=True, sliding_window=4, rope_parameters=rope,
                   layer_types=["sliding_attention", "full_attention"], num_local_experts=4, num_experts_per_tok=2,
                   intermediate_size=32, swiglu_alpha=1.702, swiglu_limit=1.0, router_aux_loss_coef=0.001,
                   output_router_logits=False)
    elif family in qwen3_5.FAMILIES:
        cfg.update(qwen3_5.defaults(family))
        cfg.pop("rope_theta")
        if family == "qwen3_5_moe":
            cfg.pop("intermediate_size")
    cfg.update(_mla_defaults(family))
    return cfg


def _mla_defaults(family: str) -> dict:
    """DeepSeek-V3: 3 MLA layers, dense then 8 experts in 4 groups, one MTP layer. Kimi-Linear: [KDA, MLA, KDA,
    MLA] with 2 KDA heads of 16 (4 MLA heads), dense then sparse. qk head dim 24 != v head dim 16 in both."""
    mla = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               q_lora_rank=None, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
               n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False)
    if family == "deepseek_v3":
        return dict(mla, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_nextn_predict_layers=1,
                    rope_interleave=True)
    if family == "kimi_linear":
        return dict(mla, num_hidden_layers=4, num_local_experts=8, linear_num_heads=2, linear_head_dim=16,
                    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
                    mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    return {}


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype (or its name), got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def _config_object(family: str, dtype, overrides: dict):
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    config_cls = getattr(transformers, FAMILIES[family][0])
    kwargs = _defaults(family)
    known = set(kwargs) | {"rope_scaling", "rope_parameters"}
    probe = config_cls()
    unknown = [k for k in overrides if k not in known and not hasattr(probe, k)]
    if unknown:
        raise ValueError(f"unknown {config_cls.__name__} field(s) {unknown} for family {family!r}")
    kwargs.update(overrides)
    if kwargs["vocab_size"] < tiny_tokenizer.VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={kwargs['vocab_size']} is smaller than the tokenizer ({tiny_tokenizer.VOCAB_SIZE} tokens)"
        )
    if kwargs["num_attention_heads"] % kwargs["num_key_value_heads"]:
        raise ValueError(f"num_attention_heads={kwargs['num_attention_heads']} is not a multiple of "
                         f"num_key_value_heads={kwargs['num_key_value_heads']}")
    if "rope_parameters" in overrides:  # transformers 5 spelling given explicitly: do not mix in the legacy one
        kwargs.pop("rope_theta", None)
        kwargs.pop("rope_scaling", None)
    # 4.56 renamed torch_dtype to dtype
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kwargs["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = _dtype_name(dtype)
    kwargs["architectures"] = [FAMILIES[family][1]]
    return config_cls(**kwargs), kwargs


def tiny_config(family: str = "qwen3", *, dtype=torch.float32, **overrides) -> dict:
    """The ``config.json`` content of a tiny checkpoint of ``family`` with ``overrides`` applied.

    Written through the installed transformers config class (``to_diff_dict``, what ``save_pretrained`` writes), with
    every field set here kept explicit and both spellings of the rope and expert-count fields (see module doc).
    """
    if family == "gemma4":  # the multimodal checkpoint, towers left out: its language model is a gemma4_text
        return gemma4_config(tiny_config("gemma4_text", dtype=dtype, **overrides))
    config, kwargs = _config_object(family, dtype, overrides)
    full = config.to_dict()
    out = config.to_diff_dict()
    for key in kwargs:
        if key in full:
            out[key] = full[key]
    rope = out.get("rope_parameters")
    if family == "gemma4_text":  # no legacy spelling: transformers reads Gemma 4's rope_parameters only
        rope = None
    elif isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):  # OLMo 3: a RoPE per layer type
        rope = rope["full_attention"]
    if isinstance(rope, dict):
        out.setdefault("rope_theta", rope.get("rope_theta"))
        if rope.get("rope_type", "default") != "default":
            out.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if family == "bailing_hybrid":
        out.pop("head_dim", None)  # transformers writes the RoPE dim there; the Hub config has the KDA head dim
        out["head_dim"] = out["linear_head_dim"]
    if family in ("deepseek_v3", "kimi_linear"):
        out.pop("head_dim", None)  # transformers writes the RoPE dim there; Hub MLA configs have none
    if family == "qwen3_moe":
        experts = out.get("num_experts", out.get("num_local_experts"))
        out["num_experts"] = out["num_local_experts"] = experts
    return dict(sorted(out.items()))


def random_weights(config: dict, *, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic random weights for ``config``: N(0, initializer_range) matrices and biases (default 0.1), norm
    scales 1 + N(0, 0.05).

    Drawn in fp32 on the CPU in the fixed order of ``weight_shapes``, then cast, so a seed gives the same tensors
    everywhere.
    """
    gen = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", WEIGHT_STD))
    dtype = getattr(torch, _dtype_name(dtype))
    out = {}
    shapes = gemma4_shapes(config) if config["model_type"].startswith("gemma4") else weight_shapes(config)
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        if config["model_type"] in qwen3_5.MODEL_TYPES and qwen3_5.zero_centered(name):
            w = NORM_NOISE_STD * w  # the model scales by 1 + weight
        else:
            w = 1.0 + NORM_NOISE_STD * w if name.endswith(ONE_LIKE) else std * w
        fp32 = name.endswith(FP32_TENSORS.get(config["model_type"], ()))
        out[name] = w.to(torch.float32 if fp32 else dtype).contiguous()
    return out


def make_tiny_checkpoint(path, family: str = "qwen3", seed: int = 0, *, dtype=torch.float32, **overrides) -> Path:
    """Write a random tiny HF checkpoint of ``family`` into ``path`` (created if needed) and return it as a Path.

    ``overrides`` set config fields (``num_hidden_layers=3``, ``hidden_size=128``, ``vocab_size`` >= the tokenizer's
    size, ``tie_word_embeddings=False``, ...); unknown fields raise ``ValueError``. ``dtype`` is the weight dtype.
    ``family="qwen3_vl"`` writes a tiny Qwen3-VL with its processor files (``areno.testing.qwen3_vl``).
    """
    from safetensors.torch import save_file

    if family == "qwen3_vl":
        return make_tiny_vl_checkpoint(path, seed, dtype=dtype, **overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, dtype=dtype, **overrides)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = random_weights(config, seed=seed, dtype=dtype)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = config.get("text_config", config)
    generation = {
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": [text["eos_token_id"], tiny_tokenizer.token_id(tiny_tokenizer.PAD_TOKEN)],
        "pad_token_id": text["pad_token_id"],
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    max_len = text.get("max_position_embeddings", text.get("model_max_length"))
    tiny_tokenizer.write_tokenizer_files(path, model_max_length=max_len)
    return path
