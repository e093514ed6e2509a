"""--speculative-tokens in a GRPO run: the colocated engine drafts with the policy's MTP layer (DeepSeek-V3, MoE:
routing replay on by default) and every logged step carries ``spec_accept_len`` (and the gate's N, ``spec_limit``);
so does a run whose engine is tensor parallel (two gloo ranks, the MTP layer sharded): colocated with --tp-size 2,
and split mode with --rollout-tp-size 2 (each rank's draft shard reloaded after the policy sync); the rollout's
log-probs are those the trainer computes."""

import json

import pytest

from areno.cli import main
from areno.testing import make_tiny_checkpoint

pytestmark = pytest.mark.slow
TP = {"tp1": [], "tp2": ["--world-size", "2", "--tp-size", "2"],
      "split_tp2": ["--train-devices", "0", "--rollout-devices", "1,2", "--rollout-tp-size", "2"]}


@pytest.mark.parametrize("tp", list(TP))
def test_grpo_run_logs_the_accept_length(tmp_path, tp, monkeypatch):
    if TP[tp]:
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
               *TP[tp]])
    assert rc == 0
    steps = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and all(1.0 <= s["spec_accept_len"] <= 3.0 for s in steps)
    assert all(s["spec_gated_steps"] == 0 for s in steps)  # beside it: the gate (auto: 32 on the CPU) never closed
    assert all(s["spec_limit"] == 32 for s in steps)  # and its N
    assert steps[0]["logprob_diff"] < 1e-4
