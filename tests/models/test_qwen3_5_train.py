"""SFT, DPO, GRPO, GSPO and PPO one step through `areno train` on the tiny Qwen3.5 (the rollout engine's recurrent
state slots for the RL algorithms), and GRPO on the MoE with routing replay: the saved step loads in transformers
with the same logits, and the MTP tensors come out untouched."""

import json

import pytest
import torch
import transformers
from hf_reference import load_reference
from safetensors import safe_open

from areno.cli import main
from areno.models import load_model
from areno.models.qwen3_5_layers import SharedExpertMoE
from tests.helpers.families import write_arith_data

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(transformers, "Qwen3_5TextConfig"),
                                                   reason=f"transformers {transformers.__version__} has no qwen3_5")]


def _mtp(folder) -> dict:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")})
    return out


def _run(ckpt, tmp_path, algo, *extra):
    data, reward = write_arith_data(tmp_path, 8)
    out = tmp_path / "out"
    args = ["train", "--algo", algo, "--ckpt", str(ckpt), "--dataset-path", str(data), "--batch-size", "4",
            "--mini-bs", "2", "--max-steps", "1", "--save-path", str(out), "--lr", "1e-3", "--no-tensorboard",
            "--dtype", "float32", *extra]
    if algo in ("grpo", "gspo", "ppo"):
        args += ["--reward-fn-path", str(reward), "--n-samples", "2", "--max-new-tokens", "5"]
    assert main(args) == 0
    saved = out / "step-1"
    assert (saved / "COMPLETE").exists()
    line = json.loads((out / "metrics" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1 and line["loss"] is not None and torch.isfinite(torch.tensor(line["loss"]))
    mine, ref = load_model(saved, device="cpu"), load_reference(saved)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(mine.logits(ids), ref(ids).logits, atol=1e-4)
    before, after = _mtp(ckpt), _mtp(saved)
    assert before and sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    return mine


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo", "gspo", "ppo"])
def test_one_training_step_end_to_end(tiny_checkpoint, tmp_path, algo):
    ckpt = tiny_checkpoint("qwen3_5")
    mine = _run(ckpt, tmp_path, algo)
    if algo == "sft":
        start = load_model(ckpt, device="cpu")
        assert any(not torch.equal(a, b) for a, b in zip(mine.parameters(), start.parameters()))


def test_grpo_on_the_moe_replays_the_rollout_routes(tiny_checkpoint, tmp_path, monkeypatch):
    given = []
    route = SharedExpertMoE.route

    def record(self, x, replay=None):
        if torch.is_grad_enabled():
            given.append(replay)
        return route(self, x, replay)

    monkeypatch.setattr(SharedExpertMoE, "route", record)
    _run(tiny_checkpoint("qwen3_5_moe"), tmp_path, "grpo", "--routing-replay", "on")
    assert given and all(g is not None and (g >= 0).any() for g in given)
