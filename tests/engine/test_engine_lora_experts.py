"""The rollout engine with an MoE expert LoRA adapter (the same ``Experts.routed`` path as training, decode through
the masked graph-capturable form): greedy tokens are PEFT's on transformers' tiny Qwen3-MoE (float32), sampled
log-probs equal the trainer's and PEFT's (float64 reference); the adapter off gives the base's."""

import pytest
import torch
from test_engine_lora import assert_lora_gap, check_greedy, check_sampled

from areno.models import load_model, load_tokenizer
from areno.models.lora import LoraSpec, attach
from areno.testing import make_tiny_checkpoint

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-experts-engine")
    path = make_tiny_checkpoint(root / "ckpt", family="qwen3_moe", seed=2)
    model = load_model(path, dtype=torch.float32, device="cpu")
    adapter = attach(model, LoraSpec(rank=4, alpha=8.0, target_modules=("experts", "q_proj")))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.eval()
    adapter.save(root / "adapter", base=str(path))
    return path, model, adapter, load_tokenizer(path), root / "adapter"


@pytest.mark.slow  # greedy, sampled and adapter-off engines plus PEFT's: ~30 s on 2 cores
def test_greedy_tokens_are_peft_s_and_logprobs_the_trainer_s(adapted):
    check_greedy(adapted)
    check_sampled(adapted, experts_implementation="eager")  # transformers' grouped_mm experts take no float64


@pytest.mark.gpu
def test_bf16_expert_lora_logprobs_match_the_trainer_with_cuda_graphs(tmp_path):
    """H200: a bf16 Qwen3-MoE at a 30B-A3B-like layer width (2 layers, 32 experts), rank-16 expert + attention
    adapter (fp32, as PEFT), the CUDA-graphed decode applying it unmerged (the masked sync-free expert path):
    ``assert_lora_gap`` (weights at a real model's scale, std 0.02: the tiny checkpoints' 0.1 amplifies bf16
    rounding)."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3_moe", seed=0, dtype=torch.bfloat16, hidden_size=2048,
                                moe_intermediate_size=768, num_hidden_layers=2, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=8,
                                initializer_range=0.02)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    adapter = attach(model, LoraSpec(rank=16, alpha=32.0, target_modules=("experts", "q_proj", "v_proj")))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.02)
    model.eval()
    assert_lora_gap(model, adapter, path)
