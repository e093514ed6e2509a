"""OLMo 2 beyond the family-parametrized parity tests: tied head / biases / one KV head variant, the option the adapter
refuses at load, tensor parallelism refused in one line, and SFT + GRPO through `areno train` on a tiny checkpoint
(OLMo 3's too)."""

import json
import random
import shutil

import pytest
import torch
from hf_reference import load_reference
from safetensors.torch import load_file

from areno.cli import main
from areno.models import load_model, save_model
from areno.models.loader import CheckpointError
from areno.models.registry import get_adapter
from areno.models.tp import apply_tp_plan


def test_variant_tied_biased_one_kv_head_matches_transformers_and_round_trips(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("olmo2", tie_word_embeddings=True, attention_bias=True, num_key_value_heads=1)
    model, ref = load_model(path, device="cpu"), load_reference(path)
    assert model.lm_head is None and model.num_kv_heads_local == 1
    assert model.layers[0].self_attn.k_proj_norm.weight.shape == (16,)  # the norm spans the whole k projection
    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model.logits(ids), ref(ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    a, b = (
        load_file(str(path / "model.safetensors")),
        load_file(str(save_model(model, tmp_path / "o") / "model.safetensors")),
    )
    assert sorted(a) == sorted(b) and "lm_head.weight" not in b
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_an_unimplemented_option_is_refused_at_load_in_one_line(tiny_checkpoint, tmp_path):
    folder = tmp_path / "dropout"
    shutil.copytree(tiny_checkpoint("olmo2"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    with pytest.raises(CheckpointError, match=r"olmo2: attention_dropout=0.1 is not supported") as e:
        load_model(folder, device="cpu")
    assert "\n" not in str(e.value)


def test_tp_wider_than_the_kv_heads_is_refused_in_one_line(tiny_checkpoint, monkeypatch):
    """The k norm spans every KV head, so replicated KV heads would count some twice: refused, not approximated (TP
    that splits the KV heads is checked against TP=1 in test_tp.py)."""
    adapter = get_adapter("olmo2")
    with torch.device("meta"):
        model = adapter.model_class(
            adapter.config_from_hf(json.loads((tiny_checkpoint("olmo2") / "config.json").read_text()))
        )
    monkeypatch.setattr("areno.models.tp.dist.get_world_size", lambda group: 4)  # 2 KV heads
    monkeypatch.setattr("areno.models.tp.dist.get_rank", lambda group: 0)
    with pytest.raises(ValueError, match=r"^--tp-size 4: olmo2 needs the TP size to divide num_key_value_heads=2") as e:
        apply_tp_plan(model, object())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
@pytest.mark.parametrize("algo", ["sft", "grpo"])
def test_one_training_step_end_to_end(tiny_checkpoint, tmp_path, algo, family):
    ckpt = tiny_checkpoint(family)
    rng = random.Random(0)
    rows = []
    for _ in range(8):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append(
            {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "response": str(a + b), "answer": str(a + b)}
        )
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record.completion) % 3 == 0)\n")
    out = tmp_path / "out"
    args = [
        "train",
        "--algo",
        algo,
        "--ckpt",
        str(ckpt),
        "--dataset-path",
        str(data),
        "--batch-size",
        "4",
        "--mini-bs",
        "2",
        "--max-steps",
        "1",
        "--save-path",
        str(out),
        "--lr",
        "1e-3",
        "--no-tensorboard",
        "--dtype",
        "float32",
    ]
    if algo == "grpo":
        args += ["--reward-fn-path", str(reward), "--n-samples", "2", "--max-new-tokens", "6"]
    assert main(args) == 0
    saved = out / "step-1"
    assert (saved / "COMPLETE").exists()
    line = json.loads((out / "metrics" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1 and line["loss"] is not None and torch.isfinite(torch.tensor(line["loss"]))
    mine, ref = load_model(saved, device="cpu"), load_reference(saved)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(mine.logits(ids), ref(ids).logits, atol=1e-4)
    if algo == "sft":
        start = load_model(ckpt, device="cpu")
        assert any(not torch.equal(a, b) for a, b in zip(mine.parameters(), start.parameters()))
