"""`areno train --optimizer-states 8bit` end to end on a tiny checkpoint: full-parameter (bf16 weights, fp32 master),
LoRA and QLoRA (the adapter's states) runs checkpoint the 8-bit moments with their absmax, a run cut and resumed equals
the uninterrupted one bit for bit, and what is not built exits 2 naming the flag (``inputs``: conftest.py)."""

import pytest
import torch
from safetensors.torch import load_file

from areno.cli import main

RUNS = {  # SFT: full-parameter on bf16 weights (an fp32 master beside 8-bit moments); LoRA (the fp32 adapter)
    "full": ("sft", "--dtype", "bfloat16"),
    "lora": ("sft", "--dtype", "float32", "--lora-rank", "4"),
    "qlora": ("sft", "--lora-rank", "4", "--quantize-base", "nf4"),  # the adapter on an NF4 base
}


def _argv(inputs, out, run, *extra, steps):
    ckpt, data, _ = inputs
    algo, *flags = RUNS[run]
    argv = ["train", "--algo", algo, "--ckpt", str(ckpt), "--dataset-path", str(data), "--batch-size", "2",
            "--mini-bs", "2", "--max-steps", str(steps), "--save-path", str(out), "--lr", "1e-2", "--no-tensorboard",
            "--seed", "3", "--save-interval", "1", "--optimizer-states", "8bit", *flags, *extra]
    return argv


def _weights(step_dir):
    name = "adapter_model.safetensors" if (step_dir / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(str(step_dir / name))


@pytest.mark.slow  # three short runs of 1-2 steps
@pytest.mark.parametrize("run", ["full", "lora", "qlora"])
def test_cut_and_resumed_run_equals_the_uninterrupted_one(inputs, tmp_path, run):
    assert main(_argv(inputs, tmp_path / "straight", run, steps=2)) == 0
    assert main(_argv(inputs, tmp_path / "cut", run, steps=1)) == 0
    saved = torch.load(tmp_path / "cut" / "step-1" / "training_state" / "optimizer-rank0.pt", weights_only=True)
    assert saved["layout"]["states"] == "8bit"
    assert all(t.dtype == torch.uint8 for t in saved["exp_avg"] + saved["exp_avg_sq"])
    assert all(a.numel() == -(-c.numel() // 256) for a, c in zip(saved["exp_avg_absmax"], saved["exp_avg"]))
    assert any(c.any() for c in saved["exp_avg"])
    assert main(_argv(inputs, tmp_path / "cut", run, "--resume", steps=2)) == 0
    a, b = _weights(tmp_path / "straight" / "step-2"), _weights(tmp_path / "cut" / "step-2")
    start = _weights(tmp_path / "straight" / "step-1")
    assert a.keys() == b.keys() and any(not torch.equal(a[k], start[k]) for k in a)  # step 2 moved weights
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt_a, opt_b = (torch.load(d / "step-2" / "training_state" / "optimizer-rank0.pt", weights_only=True)
                    for d in (tmp_path / "straight", tmp_path / "cut"))
    for key in ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
        assert all(torch.equal(x, y) for x, y in zip(opt_a[key], opt_b[key])), key


@pytest.mark.parametrize("extra,words", [
    (("--optimizer-state-offload", "cpu"), "--optimizer-states 8bit with --optimizer-state-offload cpu is not built"),
    (("--optimizer-states", "4bit"), "--optimizer-states"),
])
def test_what_is_not_built_exits_2_naming_the_flag(inputs, tmp_path, extra, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(_argv(inputs, tmp_path / "x", "full", *extra, steps=1))
    assert info.value.code == 2
    assert words in capsys.readouterr().err
