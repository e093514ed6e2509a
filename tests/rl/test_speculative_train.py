"""--speculative-tokens in a GRPO run: the colocated engine drafts with the policy's MTP layer (DeepSeek-V3, MoE:
routing replay on by default) and every logged step carries ``spec_accept_len``; with --tp-size 2 (two gloo ranks,
the MTP layer sharded) too, the rollout's log-probs those the trainer computes."""

import json

import pytest

from areno.cli import main
from areno.testing import make_tiny_checkpoint

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_run_logs_the_accept_length(tmp_path, tp, monkeypatch):
    if tp > 1:
        monkeypatch.setenv("ARENO_KERNELS", "native")  # the launched ranks' kernels on the CPU
    records = [{"prompt": [{"role": "user", "content": f"{i} * 3 ="}], "answer": str(3 * i)} for i in range(8)]
    files = {"data.jsonl": "\n".join(map(json.dumps, records)) + "\n",
             "reward.py": "def reward_fn(record):\n    return float(len(record.completion) % 3 == 0)\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="deepseek_v3", seed=0)
    data, reward, out = tmp_path / "data.jsonl", tmp_path / "reward.py", tmp_path / "out"
    rc = main(["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward),
               "--batch-size", "2", "--n-samples", "2", "--mini-bs", "2", "--max-steps", "1", "--max-new-tokens", "6",
               "--save-path", str(out), "--lr", "1e-3", "--no-tensorboard", "--dtype", "float32",
               "--speculative-tokens", "2", "--eager-decode", "--decode-steps", "1",
               *(["--world-size", str(tp), "--tp-size", str(tp)] if tp > 1 else [])])
    assert rc == 0
    steps = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and all(1.0 <= s["spec_accept_len"] <= 3.0 for s in steps)
    assert steps[0]["logprob_diff"] < 1e-4
