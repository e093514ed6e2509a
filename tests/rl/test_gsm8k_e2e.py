"""The GSM8K recipe of the spec through `areno train` on a tiny checkpoint and the GSM8K rows shipped in tests/data
(a local copy in the hub's file format: the recipe reads the full train.jsonl the same way)."""

import json
from pathlib import Path

from areno.cli import main
from areno.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT / "tests" / "data" / "gsm8k" / "train.jsonl"


def test_gsm8k_gspo_recipe_runs(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", seed=0)
    out = tmp_path / "run"
    rc = main(["train", "--ckpt", str(ckpt), "--dataset-path", str(GSM8K),
               "--dataset-loader-fn", str(ROOT / "examples/math/dataset_loader.py"),
               "--reward-fn-path", str(ROOT / "examples/math/math_verify_reward.py"),
               "--algo", "gspo", "--world-size", "1", "--tp-size", "1", "--batch-size", "1", "--n-samples", "2",
               "--mini-bs", "1", "--max-steps", "2", "--max-new-tokens", "8", "--max-prompt-tokens", "512",
               "--dtype", "float32", "--no-tensorboard", "--save-path", str(out)])
    assert rc == 0
    lines = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert all(x["reward_failures"] == 0 and x["response_len_mean"] > 0 for x in lines)
    assert (out / "step-2" / "COMPLETE").exists()
