"""DeepSeek-V3 (deepseek_v3: MLA + sigmoid group-limited MoE with shared experts, dense first layers, MTP kept)
against transformers' own model: fp32 logits (packed varlen too) and every gradient, q_lora / NeoX-rope / YaRN
variants, the Hub-name round trip with the MTP layer untouched, transformers loading what areno saves, routing replay,
and the refusals (FP8 weights, other routers). Needs a transformers with deepseek_v3 (5.x)."""


import pytest
import torch
import transformers
from hf_reference import (
    assert_bf16_parity_on_gpu,
    assert_fp32_parity,
    assert_replay_and_checkpointing_agree,
    assert_same_checkpoint,
    assert_transformers_loads_saved,
    load_reference,
    reference_grads,
    with_config_change,
)

from areno.models import load_model, save_model

pytestmark = pytest.mark.skipif(not hasattr(transformers, "DeepseekV3Config"),
                                reason=f"transformers {transformers.__version__} has no deepseek_v3")

YARN = dict(type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=8,
            beta_fast=32, beta_slow=1)
VARIANTS = {
    "mtp": {},  # 3 layers (dense, MoE, MoE), q_proj directly, interleaved RoPE, one MTP layer
    "q_lora_yarn": dict(q_lora_rank=24, v_head_dim=32, rope_scaling=YARN, num_nextn_predict_layers=0),
    "neox": dict(rope_interleave=False, first_k_dense_replace=0, n_group=1, topk_group=1),
}


def _ids(vocab=1000, b=2, t=19, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_gradients_match_transformers_fp32(tiny_checkpoint, variant):
    path = tiny_checkpoint("deepseek_v3", **VARIANTS[variant])
    model, ref = load_model(path, device="cpu"), load_reference(path)
    cfg = model.config
    assert cfg.num_mtp_layers == VARIANTS[variant].get("num_nextn_predict_layers", 1)
    assert len(model.mtp_names) == 42 * cfg.num_mtp_layers  # the MTP layer's tensors, held untouched
    assert_fp32_parity(model, ref, reference_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_areno_hf_is_bit_identical_with_mtp_layers(tmp_path, dtype):
    from areno.testing import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "deepseek_v3", dtype=dtype)
    model = load_model(src, device="cpu")
    assert model.layers[1].mlp.gate.weight.dtype == model.layers[1].mlp.gate.expert_bias.dtype == torch.float32
    out = save_model(model, tmp_path / "out")
    a = assert_same_checkpoint(src, out)
    assert any(k.startswith("model.layers.3.eh_proj") for k in a)


def test_transformers_loads_what_areno_saves(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint("deepseek_v3", **VARIANTS["q_lora_yarn"]), device="cpu")
    assert_transformers_loads_saved(model, tmp_path / "trained", load_model, save_model)


def test_routing_replay_and_activation_checkpointing(tiny_checkpoint):
    model = load_model(tiny_checkpoint("deepseek_v3"), device="cpu").train()
    assert model.num_moe_layers == 2
    assert_replay_and_checkpointing_agree(model)


@pytest.mark.parametrize("fields, message", [
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     "quantization_config \\(fp8.*dequantize"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 != num_attention_heads=4"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}, rope_parameters=None), "rope_type 'dynamic'"),
])  # fmt: skip
def test_refuses_what_it_does_not_implement(tiny_checkpoint, tmp_path, fields, message):
    from areno.models.loader import CheckpointError

    with pytest.raises((ValueError, NotImplementedError, CheckpointError), match=message):
        load_model(with_config_change(tiny_checkpoint("deepseek_v3"), tmp_path / "edited", fields), device="cpu")


# ---- GPU (bf16, Triton kernels): python -m pytest -q tests/models/test_deepseek_v3.py -m gpu -----------------------

DEEPSEEK_V3_SMALL = dict(  # DeepSeek-V3's attention (YaRN as on the Hub), dense-MLP and expert shapes; 2 layers
    hidden_size=7168, intermediate_size=18432, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=2048,
    vocab_size=32768, max_position_embeddings=16384, num_nextn_predict_layers=0,
    rope_scaling=dict(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096,
                      beta_fast=32, beta_slow=1),
)  # fmt: skip


@pytest.mark.gpu
def test_bf16_parity_on_gpu(tmp_path):
    """bf16 logits at DeepSeek-V3's widths (see assert_bf16_parity_on_gpu)."""
    from areno.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "deepseek_v3", dtype=torch.bfloat16, **DEEPSEEK_V3_SMALL)
    assert_bf16_parity_on_gpu(path, load_model)
