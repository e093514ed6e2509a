"""examples/vision, shortened: the generated counting task, a tiny Qwen3-VL from scratch, an SFT warm-up then GRPO
through the training loop, with images in rollout, training and evaluation. The learning signal is asserted: the
warm-up lifts the held-out accuracy well above the untrained model's, GRPO raises the sampled reward."""

import importlib.util
import json
from pathlib import Path

import pytest

from areno.config import TrainConfig
from areno.rl.loop import TrainLoop
from areno.rl.rewards import record_from
from areno.training.plugins import load_reward_fn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vision"


def _module(name):
    spec = importlib.util.spec_from_file_location(f"vision_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shapes_rows_hold_out_unseen_pictures_and_the_reward_reads_the_count(tmp_path):
    shapes = _module("shapes")
    path = shapes.make_dataset(tmp_path, train=40, eval=10, seed=3)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r.get("split") for r in rows] == [None] * 40 + ["eval"] * 10
    assert {r["answer"] for r in rows} <= {"0", "1", "2", "3", "4"} and len({r["answer"] for r in rows}) >= 3
    files = [(tmp_path / r["prompt"][0]["content"][0]["image_url"]["url"]).read_bytes() for r in rows]
    assert len(set(files)) == len(files)
    reward = load_reward_fn(str(EXAMPLE / "reward.py"))
    row = rows[0]
    assert reward(record_from(row, f"{row['answer']}", [], 0)) == 1.0
    assert reward(record_from(row, f"{(int(row['answer']) + 1) % 5} squares", [], 0)) == 0.0
    assert reward(record_from(row, "none", [], 0)) == 0.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    data = _module("shapes").make_dataset(root / "data", train=300, eval=40, seed=0)
    _module("make_model").main([str(root / "model")])
    cfg = TrainConfig(ckpt=str(root / "model"), dataset_path=str(data), reward_fn_path=str(EXAMPLE / "reward.py"),
                      algo="grpo", sft_warmup_steps=30, sft_warmup_lr=1e-3, lr=1e-3, batch_size=16, n_samples=8,
                      mini_bs=128, max_steps=12, max_new_tokens=2, unfreeze_mm_tower=True, unfreeze_mm_projector=True,
                      dtype="float32", tensorboard=False, metrics_dir=str(root / "metrics"), seed=0)  # fmt: skip
    loop = TrainLoop(cfg)
    loop.setup()
    try:
        untrained = loop.evaluate()
        loop.warmup()
        warm = loop.evaluate()
        batches = iter(loop.data)
        rewards = [loop.step(next(batches))["reward_mean"] for _ in range(cfg.max_steps)]
        yield untrained, warm, rewards
    finally:
        loop.close()


def test_sft_warm_up_then_grpo_learn_to_count(run):
    untrained, warm, rewards = run
    assert warm >= untrained + 0.15, (untrained, warm)  # the warm-up learns to read the pictures
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.1, rewards  # GRPO raises the reward of the sampled answers
