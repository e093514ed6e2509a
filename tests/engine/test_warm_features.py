"""The engine warms the paged-attention variants its model calls: a sliding window and attention sinks are their own
compiled variants, found from the model's attention layers."""

from types import SimpleNamespace

import pytest
import torch

from areno.engine.model_runner import ModelRunner
from areno.models import load_model
from areno.testing import make_tiny_checkpoint


@pytest.mark.parametrize("family, want", [
    ("qwen3", ((False, None),)),
    ("olmo3", ((False, None), (True, None))),  # [sliding, full]
    ("gpt_oss", ((False, torch.float32), (True, torch.float32))),  # sinks on every layer, alternate windows
])
def test_attention_features_name_every_variant_the_layers_call(tmp_path, family, want):
    model = load_model(make_tiny_checkpoint(tmp_path / family, family), device="cpu", attn_backend="native")
    got = ModelRunner.attention_features(SimpleNamespace(model=model))
    assert sorted(got, key=str) == sorted(want, key=str)
