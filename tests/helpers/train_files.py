"""Files for `areno train` tests: a small arithmetic dataset (SFT, DPO and RL columns) and a reward plugin."""

import json
import random


def write_train_files(root, num_rows: int, seed: int = 0):
    """``root/data.jsonl`` (``num_rows`` "a+b=" rows with response, answer, chosen, rejected) and ``root/reward.py``
    (rewards completions whose length is a multiple of 3); returns their paths."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "response": str(a + b),
                     "answer": str(a + b), "chosen": str(a + b), "rejected": str(a + b + 1)})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = root / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record.completion) % 3 == 0)\n")
    return data, reward
