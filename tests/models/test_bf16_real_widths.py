"""bf16 parity on the GPU at the real layer widths of a published checkpoint of OLMo 2, Olmo 3 and gpt-oss (a few
layers, a smaller vocabulary), with the bar of the other families' GPU tests (``assert_bf16_parity_on_gpu``).

    python -m pytest -q tests/models/test_bf16_real_widths.py -m gpu
"""

import pytest
import torch
import transformers
from hf_reference import assert_bf16_parity_on_gpu

from areno.models import load_model

OLMO2_7B = dict(  # OLMo-2-1124-7B: 32 heads of 128 (no GQA), QK-norm over the projections, MLP 11008; 2 layers
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32,
    head_dim=128, rope_theta=500000.0, max_position_embeddings=4096,
)  # fmt: skip
OLMO3_YARN = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
              "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.2079441541679836}
OLMO3_7B = dict(  # Olmo-3-7B: OLMo 2's widths, [sliding x3, full] layers, YaRN on the full layers only; one group
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=32,
    head_dim=128, max_position_embeddings=65536, layer_types=["sliding_attention"] * 3 + ["full_attention"],
    sliding_window=128,  # (4096 on the Hub) shorter than the 300 tokens read, so the window bites
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                     "full_attention": OLMO3_YARN},
)  # fmt: skip
GPT_OSS_20B = dict(  # gpt-oss-20b: 64 query / 8 KV heads of 64 with sinks, 32 experts of 2880 top-4, clamped SwiGLU
    # (limit 7), YaRN x32, a 128-token window on alternate layers; 2 layers (sliding, full)
    hidden_size=2880, intermediate_size=2880, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
)  # fmt: skip
SHAPES = [("olmo2", "Olmo2Config", OLMO2_7B), ("olmo3", "Olmo3Config", OLMO3_7B),
          ("gpt_oss", "GptOssConfig", GPT_OSS_20B)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "shape"), [
    pytest.param(family, shape, id=family, marks=pytest.mark.skipif(
        not hasattr(transformers, config), reason=f"transformers {transformers.__version__} has no {family}"))
    for family, config, shape in SHAPES
])  # fmt: skip
def test_bf16_parity_on_gpu(tmp_path, family, shape):
    """bf16 logits (and a checkpointed training step) at the family's real widths, vocabulary 32,768."""
    from areno.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, family, dtype=torch.bfloat16, vocab_size=32768, **shape)
    assert_bf16_parity_on_gpu(path, load_model)
