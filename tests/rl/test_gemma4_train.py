"""Gemma 4 through `areno train`: one step of every algorithm on a tiny checkpoint with every feature on (KV-shared
layers, PLE, k = v, double-wide MLP, the MoE block, soft-capping); the saved checkpoint reloads in transformers with
the same logits, and on the first on-policy GRPO step the trainer's soft-capped log-probs equal the rollout's."""

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from areno.cli import main
from areno.models import load_model
from areno.testing import make_tiny_checkpoint
from areno.testing.gemma4 import EVERY_FEATURE
from tests.helpers.families import write_arith_data

pytestmark = pytest.mark.skipif(not hasattr(transformers, "Gemma4TextConfig"),
                                reason=f"transformers {transformers.__version__} has no Gemma 4")



@pytest.fixture(scope="module")
def setup_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-train")
    ckpt = make_tiny_checkpoint(root / "ckpt", family="gemma4_text", seed=0, **EVERY_FEATURE)
    data, reward = write_arith_data(root, 8)
    return ckpt, data, reward, root


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo", "gspo", "ppo"])
def test_one_step_of_every_algorithm_end_to_end(setup_files, algo):
    ckpt, data, reward, root = setup_files
    out = root / f"out-{algo}"
    args = ["train", "--algo", algo, "--ckpt", str(ckpt), "--dataset-path", str(data), "--batch-size", "2",
            "--mini-bs", "2", "--max-steps", "1", "--save-path", str(out), "--lr", "1e-3", "--no-tensorboard",
            "--dtype", "float32"]
    if algo not in ("sft", "dpo"):
        args += ["--reward-fn-path", str(reward), "--n-samples", "2", "--max-new-tokens", "5"]
    if algo == "grpo":
        args += ["--routing-replay", "on"]
    assert main(args) == 0
    saved = out / "step-1"
    assert (saved / "COMPLETE").exists()
    line = json.loads((out / "metrics" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1 and line["loss"] is not None and torch.isfinite(torch.tensor(line["loss"]))
    if "logprob_diff_max" in line:  # first on-policy step: the trainer's log-probs are the rollout's
        assert line["logprob_diff_max"] < 1e-4
    mine = load_model(saved, dtype=torch.float32, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(mine.logits(ids), hf(ids).logits, atol=1e-4)
    if algo in ("sft", "dpo"):
        start = load_model(ckpt, dtype=torch.float32, device="cpu")
        assert any(not torch.equal(a, b) for a, b in zip(mine.parameters(), start.parameters()))
