"""--speculative-tokens in a GRPO run: the colocated engine drafts with the policy's MTP layer (DeepSeek-V3, MoE:
routing replay on by default) and every logged step carries ``spec_accept_len``."""

import json

import pytest

from areno.cli import main
from areno.testing import make_tiny_checkpoint

pytestmark = pytest.mark.slow


def test_grpo_run_logs_the_accept_length(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="deepseek_v3", seed=0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)})
                            + "\n" for i in range(8)))
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record.completion) % 3 == 0)\n")
    out = tmp_path / "out"
    rc = main(["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward),
               "--batch-size", "2", "--n-samples", "2", "--mini-bs", "2", "--max-steps", "1", "--max-new-tokens", "6",
               "--save-path", str(out), "--lr", "1e-3", "--no-tensorboard", "--dtype", "float32",
               "--speculative-tokens", "2", "--eager-decode", "--decode-steps", "1"])
    assert rc == 0
    steps = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and all(1.0 <= s["spec_accept_len"] <= 3.0 for s in steps)
