"""A model folder that cannot be loaded is one line naming the file and what is wrong (issue 37, point 16): a
config.json that is not JSON, not an object, without model_type or naming an unknown architecture (refused by the
CLI's model-folder check before anything runs), a mistyped config field, weights cut short or corrupt, weights made
for another config."""

import json
import shutil

import pytest

from areno.config import ConfigError
from areno.models import load_model
from areno.models.loader import CheckpointError, check_engine_support, check_model_source


def _copy(src, dst, **changes):
    shutil.copytree(src, dst)
    if changes:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


@pytest.mark.parametrize("text,needle", [
    ('{"model_type": "qwen3",', r"config.json is not valid JSON \(Expecting property name"),
    ("[1, 2]", "config.json holds a JSON list, not an object"),
    ('{"hidden_size": 64}', "config.json has no model_type"),
    ('{"model_type": "mamba9", "architectures": ["Mamba9ForCausalLM"]}',
     "model_type 'mamba9' is not supported by areno's adapters"),
])
def test_a_bad_config_json_is_refused_at_the_flag_in_one_line(tiny_checkpoint, tmp_path, text, needle):
    folder = _copy(tiny_checkpoint("qwen3"), tmp_path / "bad")
    (folder / "config.json").write_text(text)
    for check in (check_model_source, check_engine_support):  # every --ckpt; the rollout engine's model
        with pytest.raises(ConfigError, match=needle) as e:
            check("--ckpt", folder)
        assert str(e.value).startswith(f"--ckpt '{folder}' cannot be loaded: ") and "\n" not in str(e.value)
    with pytest.raises((CheckpointError, ValueError), match=needle):
        load_model(folder, device="cpu")


def test_weights_made_for_another_config_name_the_tensor_and_both_shapes(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint("qwen3"), tmp_path / "wide", hidden_size=128)  # the weights are 64 wide
    with pytest.raises(CheckpointError, match=r"tensor model\.embed_tokens\.weight of \S*wide has shape \[1000, 64\] "
                                              r"where the model built from config.json needs \[1000, 128\]: "
                                              "config.json does not match the weights"):
        load_model(folder, device="cpu")
    deeper = _copy(tiny_checkpoint("qwen3"), tmp_path / "deep", num_hidden_layers=3,
                   layer_types=["full_attention"] * 3)
    with pytest.raises(KeyError, match=r"lacks \d+ tensors .*model\.layers\.2\..*does config.json match the weights"):
        load_model(deeper, device="cpu")


def test_a_mistyped_config_field_names_the_file(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint("qwen3"), tmp_path / "typo", hidden_size="sixty-four")
    with pytest.raises(CheckpointError, match=r"typo/config.json cannot be read as a qwen3 config: .*hidden_size"):
        load_model(folder, device="cpu")


@pytest.mark.parametrize("damage", ["cut", "garbage", "header-only"])
def test_cut_or_corrupt_weights_name_the_file(tiny_checkpoint, tmp_path, damage):
    folder = _copy(tiny_checkpoint("qwen3"), tmp_path / damage)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"cut": data[: len(data) * 9 // 10], "garbage": bytes(range(256)) * 64,
                         "header-only": data[:5]}[damage])
    with pytest.raises(CheckpointError, match=rf"{damage}/model.safetensors is not a readable safetensors file "
                                              r"\(cut short or corrupt\?\): ") as e:
        load_model(folder, device="cpu")
    assert "\n" not in str(e.value)


def test_a_broken_shard_index_names_the_file(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint("qwen3"), tmp_path / "index")
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json is not a safetensors index \(KeyError"):
        load_model(folder, device="cpu")
