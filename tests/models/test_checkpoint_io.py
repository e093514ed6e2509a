"""Hugging Face load/save: round trips bit-identical, transformers reads what areno writes, sharding, errors."""

import json

import pytest
import torch
from hf_reference import FAMILIES, load_reference
from safetensors import safe_open

from areno.models import load_model, load_tokenizer, save_model


def _tensors(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_areno_hf_is_bit_identical(tiny_checkpoint, tmp_path, family):
    src = tiny_checkpoint(family)
    out = save_model(load_model(src, device="cpu"), tmp_path / "out")
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (out / "generation_config.json").read_text() == (src / "generation_config.json").read_text()
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert not list(tmp_path.glob("out.*")), "temporary folders left behind"


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_saved_model_with_same_logits(tiny_checkpoint, tmp_path, family):
    model = load_model(tiny_checkpoint(family), device="cpu")
    with torch.no_grad():  # change the weights so the test sees what was saved, not the source checkpoint
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = save_model(model, tmp_path / "trained", tokenizer=load_tokenizer(tiny_checkpoint(family)))
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        want = model.logits(ids)
        got = load_reference(out)(ids).logits
        again = load_model(out, device="cpu").logits(ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(again, want)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # experts per expert / fused per layer on the Hub
def test_sharded_save_writes_index_and_reloads(tiny_checkpoint, tmp_path, family):
    src = tiny_checkpoint(family)
    model = load_model(src, device="cpu")
    out = save_model(model, tmp_path / "sharded", max_shard_size=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _tensors(src).values())
    for f in files:  # no shard exceeds the limit unless one tensor alone does
        with safe_open(str(f), framework="pt") as h:
            sizes = [h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys()]
        assert sum(sizes) <= 200_000 or len(sizes) == 1
    ids = torch.randint(0, 1000, (1, 9))
    with torch.no_grad():
        want = model.logits(ids)
        assert torch.equal(load_model(out, device="cpu").logits(ids), want)
        assert (load_reference(out)(ids).logits - want).abs().max() <= 1e-4 * want.abs().max()


def test_dtype_choice_and_saved_config_dtype(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3")
    model = load_model(src, dtype=torch.bfloat16, device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.rope[0].dtype == torch.float32  # RoPE tables stay fp32
    out = save_model(model, tmp_path / "bf16")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in _tensors(out).values())
    assert load_model(out, device="cpu").embed_tokens.weight.dtype == torch.bfloat16  # the config's dtype by default


def test_tied_embeddings_have_no_lm_head(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3"), device="cpu")
    assert model.config.tie_word_embeddings and model.lm_head is None
    assert model.lm_head_weight is model.embed_tokens.weight
    assert "lm_head.weight" not in _tensors(tiny_checkpoint("qwen3"))


def test_save_replaces_existing_folder(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint("llama"), device="cpu")
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    save_model(model, target)
    assert not (target / "stale.txt").exists() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_unknown_model_type_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"'gpt2' is not supported.*llama.*qwen3.*qwen3_moe"):
        load_model(tmp_path, device="cpu")


def test_unresolvable_repo_id_says_how_to_pass_a_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"could not resolve model 'nobody/no-such-model'.*local folder"):
        load_model("nobody/no-such-model", device="cpu")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_model("/no/such/folder", device="cpu")


def test_missing_and_unexpected_tensors_are_errors(tiny_checkpoint, tmp_path):
    from safetensors.torch import save_file

    src = tiny_checkpoint("llama")
    tensors = _tensors(src)
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_model(folder, device="cpu")
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match="model.extra.weight"):
        load_model(folder, device="cpu")


def test_load_tokenizer_reads_the_folder(tiny_checkpoint):
    tok = load_tokenizer(tiny_checkpoint("qwen3"))
    ids = tok("hello world")["input_ids"]
    assert ids and tok.decode(ids) == "hello world"


def test_saved_weights_have_the_folders_file_mode(tiny_checkpoint, tmp_path):
    """safetensors writes 0600; a checkpoint's weights must be as readable as its config (a served or shared folder)."""
    out = save_model(load_model(tiny_checkpoint("qwen3"), device="cpu"), tmp_path / "out", max_shard_size=200_000)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert len([n for n in modes if n.endswith(".safetensors")]) > 1
    assert len(set(modes.values())) == 1, modes

