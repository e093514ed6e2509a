"""SFT, DPO, GRPO, GSPO and PPO one step through `areno train` on tiny DeepSeek-V3 (MTP layer kept) and Kimi-Linear
checkpoints, RL with routing replay on: a saved checkpoint areno and transformers load to the same logits, the MTP
tensors bit-identical to the source."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from areno.cli import main
from areno.models import load_model
from areno.testing import make_tiny_checkpoint
from tests.helpers.families import write_arith_data


def hub_tensors(folder) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


CONFIG_CLASS = {"deepseek_v3": "DeepseekV3Config", "kimi_linear": "KimiLinearConfig"}


@pytest.fixture(scope="module", params=sorted(CONFIG_CLASS))
def setup_files(request, tmp_path_factory):
    if not hasattr(transformers, CONFIG_CLASS[request.param]):
        pytest.skip(f"transformers {transformers.__version__} has no {request.param}")
    root = tmp_path_factory.mktemp(request.param)
    ckpt = make_tiny_checkpoint(root / "ckpt", family=request.param, seed=0)
    data, reward = write_arith_data(root, 8)
    return ckpt, data, reward, root


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo", "gspo", "ppo"])
def test_one_step_of_every_algorithm(setup_files, algo):
    ckpt, data, reward, root = setup_files
    out = root / f"out-{algo}"
    args = ["train", "--algo", algo, "--ckpt", str(ckpt), "--dataset-path", str(data), "--batch-size", "4",
            "--mini-bs", "2", "--max-steps", "1", "--save-path", str(out), "--lr", "1e-3", "--no-tensorboard",
            "--dtype", "float32"]
    if algo not in ("sft", "dpo"):
        args += ["--reward-fn-path", str(reward), "--n-samples", "2", "--max-new-tokens", "6",
                 "--routing-replay", "on"]
    assert main(args) == 0
    saved = out / "step-1"
    assert (saved / "COMPLETE").exists()
    line = json.loads((out / "metrics" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1 and line["loss"] is not None and torch.isfinite(torch.tensor(line["loss"]))
    mine = load_model(saved, dtype=torch.float32, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(mine.logits(ids), hf(ids).logits, atol=1e-4)
    before, after = hub_tensors(ckpt), hub_tensors(saved)
    assert sorted(before) == sorted(after)
    n = mine.config.num_layers
    kept = [k for k in before if k.startswith(f"model.layers.{n}.")]  # the MTP layer (DeepSeek-V3)
    assert all(torch.equal(before[k], after[k]) for k in kept) and (len(kept) > 0) == (mine.config.num_mtp_layers > 0)
    if algo in ("sft", "dpo"):
        assert any(not torch.equal(before[k], after[k]) for k in before)
