"""Kimi-Linear (kimi_linear: KDA with low-rank gates + NoPE MLA + sigmoid-routed MoE) against transformers' own model:
fp32 logits (packed varlen too) and every gradient, the Hub-name round trip (fp32 and bf16), transformers loading
what areno saves, the layer types read from a Hub-style ``linear_attn_config``, and the refusals. Needs a transformers
with kimi_linear (5.2x)."""

import json
import shutil

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
    renamed_grads,
    with_config_change,
)

from areno.models import load_model, save_model

pytestmark = pytest.mark.skipif(not hasattr(transformers, "KimiLinearConfig"),
                                reason=f"transformers {transformers.__version__} has no kimi_linear")

VARIANTS = {
    "base": {},  # [KDA, MLA, KDA, MLA], 2 KDA heads of 16 (4 MLA heads), dense then sparse MLPs, q_proj directly
    "q_lora": dict(q_lora_rank=24, v_head_dim=32),
}


def _ids(vocab=1000, b=2, t=19, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _hub_grads(ref) -> dict:
    """transformers' gradients under the Hub names it renamed at load: the MoE under block_sparse_moe with per-expert
    w1/w3/w2, the forget gate's tensors back on the attention, conv kernels split back."""
    sparse = ref.config.mlp_layer_types

    def rename(name):
        name, parts = name.replace(".forget_gate.", "."), name.split(".")
        if len(parts) > 3 and parts[3] == "mlp" and sparse[int(parts[2])] == "sparse":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        return name

    return renamed_grads(ref, rename, ("w1", "w3", "w2"))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_gradients_match_transformers_fp32(tiny_checkpoint, variant):
    path = tiny_checkpoint("kimi_linear", **VARIANTS[variant])
    model, ref = load_model(path, device="cpu"), load_reference(path)
    cfg = model.config
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2 and cfg.num_experts == 8
    assert model.layers[0].self_attn.num_heads == 2 and model.layers[1].self_attn.num_heads == 4
    assert model.recurrent_state_shapes() == {"layers": [0, 2], "conv": (96, 3), "recurrent": (2, 16, 16)}
    assert_fp32_parity(model, ref, _hub_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_areno_hf_is_bit_identical(tmp_path, dtype):
    from areno.testing import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "kimi_linear", dtype=dtype)
    model = load_model(src, device="cpu")
    kda = model.layers[0].self_attn
    assert kda.decay.dt_bias.dtype == model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert kda.decay.A_log.dtype == kda.conv.weight.dtype == dtype  # as transformers keeps them
    out = save_model(model, tmp_path / "out")
    a = assert_same_checkpoint(src, out)
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in a


def test_transformers_loads_what_areno_saves(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint("kimi_linear", **VARIANTS["q_lora"]), device="cpu")
    assert_transformers_loads_saved(model, tmp_path / "trained", load_model, save_model)


def test_routing_replay_and_activation_checkpointing(tiny_checkpoint):
    model = load_model(tiny_checkpoint("kimi_linear"), device="cpu").train()
    assert model.num_moe_layers == 3
    assert_replay_and_checkpointing_agree(model)


def _hub_style(src, tmp_path, drop, **fields):
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key in drop:
        config.pop(key)
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_reads_the_hub_linear_attn_config(tiny_checkpoint, tmp_path):
    """A Hub config.json: the KDA shape and the (1-indexed) layer lists in ``linear_attn_config``."""
    src = tiny_checkpoint("kimi_linear")
    hub = dict(linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                   "kda_layers": [1, 3], "full_attn_layers": [2, 4]}, first_k_dense_replace=1)
    drop = ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")
    model = load_model(_hub_style(src, tmp_path, drop, **hub), device="cpu")
    assert model.config.layer_types == ["linear_attention", "full_attention"] * 2
    assert model.config.mlp_layer_types == ["dense"] + ["sparse"] * 3
    ids = _ids(t=9, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), load_model(src, device="cpu").logits(ids), rtol=0, atol=0)


@pytest.mark.parametrize("fields, message", [
    (dict(mla_use_nope=False), "mla_use_nope=False is not supported"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func='softmax' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(use_grouped_topk=False), "use_grouped_topk=false with num_expert_group > 1"),
    (dict(quantization_config={"quant_method": "compressed-tensors"}), "quantization_config"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 != num_attention_heads=4"),
])  # fmt: skip
def test_refuses_what_it_does_not_implement(tiny_checkpoint, tmp_path, fields, message):
    from areno.models.loader import CheckpointError

    with pytest.raises((ValueError, NotImplementedError, CheckpointError), match=message):
        load_model(with_config_change(tiny_checkpoint("kimi_linear"), tmp_path / "edited", fields), device="cpu")


# ---- GPU (bf16, Triton kernels): python -m pytest -q tests/models/test_kimi_linear.py -m gpu -----------------------

KIMI_LINEAR_SMALL = dict(  # Kimi-Linear-48B-A3B's KDA, MLA and expert shapes; 3 layers (KDA, KDA, MLA), 64 experts
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=32,
    linear_num_heads=32, linear_head_dim=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_local_experts=64, num_experts_per_tok=8, n_group=1, topk_group=1, moe_intermediate_size=1024,
    routed_scaling_factor=2.446, vocab_size=32768, max_position_embeddings=8192,
    layer_types=["linear_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
)  # fmt: skip


@pytest.mark.gpu
def test_bf16_parity_on_gpu(tmp_path):
    """bf16 logits at Kimi-Linear's widths (see assert_bf16_parity_on_gpu)."""
    from areno.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "kimi_linear", dtype=torch.bfloat16, **KIMI_LINEAR_SMALL)
    assert_bf16_parity_on_gpu(path, load_model)
