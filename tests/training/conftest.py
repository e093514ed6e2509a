"""Shared by the LoRA and QLoRA run tests: a tiny qwen3 checkpoint, addition rows (one held out) and a reward."""

import json
import random

import pytest


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(checkpoint, dataset, reward file) of `areno train` runs: rows with response, answer, chosen, rejected."""
    from areno.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora-run")
    rng = random.Random(0)
    rows = []
    for i in range(8):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "response": str(a + b),
                     "answer": str(a + b), "chosen": str(a + b), "rejected": str(a + b + 1),
                     **({"split": "eval"} if i == 7 else {})})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = root / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(sum(map(ord, record.completion)) % 2)\n")
    return make_tiny_checkpoint(root / "model", "qwen3", seed=0), data, reward
