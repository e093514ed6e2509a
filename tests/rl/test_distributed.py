"""`areno train --world-size 2` on gloo through torch's elastic launcher: data parallel and tensor parallel give
the same update as one process on the same global batch."""

import json

import pytest
import torch

from areno.cli import main
from areno.models import load_model
from tests.rl.test_loop import setup_files  # noqa: F401  (the shared tiny checkpoint and data)


def run(setup_files, out, *extra):  # noqa: F811
    ckpt, data, reward, _ = setup_files
    args = ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--batch-size", "8", "--mini-bs", "2",
            "--max-steps", "1", "--save-path", str(out), "--lr", "1e-3", "--dtype", "float32", "--no-tensorboard",
            "--reward-fn-path", str(reward), "--max-new-tokens", "6", *extra]
    assert main(args) == 0
    return load_model(out / "step-1", dtype=torch.float32, device="cpu")


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def single(setup_files, tmp_path_factory):  # noqa: F811
    return run(setup_files, tmp_path_factory.mktemp("tp1"), "--algo", "sft", "--gradient-accumulation-steps", "4")


def test_data_parallel_2_equals_one_process(setup_files, single, tmp_path):  # noqa: F811
    # 2 ranks x 2 rows x 2 microbatches = the single process's 2 rows x 4 microbatches: one update of 8 rows
    dp = run(setup_files, tmp_path / "dp2", "--algo", "sft", "--gradient-accumulation-steps", "2",
             "--world-size", "2")
    assert max_diff(single, dp) < 1e-4


def test_tensor_parallel_2_equals_one_process(setup_files, single, tmp_path):  # noqa: F811
    tp = run(setup_files, tmp_path / "tp2", "--algo", "sft", "--gradient-accumulation-steps", "4",
             "--world-size", "2", "--tp-size", "2")
    assert max_diff(single, tp) < 1e-4


def test_grpo_on_a_tp_group_keeps_the_on_policy_invariants(setup_files, tmp_path):  # noqa: F811
    out = tmp_path / "grpo"
    run(setup_files, out, "--algo", "grpo", "--n-samples", "2", "--batch-size", "4", "--world-size", "2",
        "--tp-size", "2")
    (line,) = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert line["logprob_diff_max"] < 1e-4
