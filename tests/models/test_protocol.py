"""Every registered adapter (the tiny checkpoints of areno.testing) and the PPO critic implement the model Protocol,
with the capability values their families have."""

import pytest

from areno.models import load_model
from areno.models.protocol import ModelProtocol, TrainedModel
from areno.models.registry import BUILTIN, get_adapter

# family -> (is_moe, is_hybrid, is_multimodal, has_routing_bias, kv_cache_layout is None)
CAPABILITIES = {
    "qwen3": (False, False, False, False, True),
    "qwen3_moe": (True, False, False, False, True),
    "llama": (False, False, False, False, True),
    "bailing_hybrid": (True, True, False, True, False),
    "qwen3_vl": (False, False, True, False, True),
    "olmo2": (False, False, False, False, True),
    "olmo3": (False, False, False, False, True),
    "gpt_oss": (True, False, False, False, True),
    "deepseek_v3": (True, False, False, True, False),
    "kimi_linear": (True, True, False, True, False),
    "qwen3_5": (False, True, False, False, True),
    "gemma4": (False, False, False, False, False),
}


def test_every_builtin_family_is_checked():
    assert set(CAPABILITIES) == set(BUILTIN)


@pytest.mark.parametrize("family", sorted(CAPABILITIES))
def test_adapter_satisfies_protocol(tiny_checkpoint, family):
    model = load_model(tiny_checkpoint(family), device="cpu")
    assert isinstance(model, get_adapter(model.hf_config["model_type"]).model_class)
    assert isinstance(model, ModelProtocol) and isinstance(model, TrainedModel)
    moe, hybrid, multimodal, bias, plain_cache = CAPABILITIES[family]
    assert (model.is_moe, model.is_hybrid, model.is_multimodal, model.has_routing_bias) == (moe, hybrid, multimodal,
                                                                                             bias)
    assert (model.kv_cache_layout is None) == plain_cache
    assert model.is_value_model is False and model.tp_group is None and model.engine_support is None
    assert model.is_moe == (model.num_moe_layers > 0) and (model.moe_top_k > 0) == model.is_moe
    assert model.tie_word_embeddings == model.config.tie_word_embeddings
    assert model.hf_config["model_type"].removesuffix("_text") == family and model.source_dir is not None
    assert model.activation_checkpointing is False
    model.set_activation_checkpointing(True)
    assert model.activation_checkpointing and all(layer.checkpointing for layer in model.layers)
    if not multimodal:
        assert model.tower_parameters() == [] and model.projector_parameters() == []
        with pytest.raises(NotImplementedError):
            model.encode_images(None, None)
    if not bias:
        with pytest.raises(NotImplementedError):
            model.update_routing_bias(0.1)


def test_critic_satisfies_trained_model(tiny_checkpoint):
    from areno.rl.critic import ValueModel

    policy = load_model(tiny_checkpoint("qwen3"), device="cpu")
    critic = ValueModel.from_policy(None, policy, dtype=None, device="cpu")
    assert isinstance(critic, TrainedModel) and not isinstance(critic, ModelProtocol)
    assert critic.is_value_model and not critic.has_routing_bias and critic.tp_group is None
    assert critic.config is critic.backbone.config and critic.is_multimodal is False
