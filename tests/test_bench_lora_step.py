"""bench/lora_step.py --smoke on the CPU: LoRA GRPO rows through areno's train path (the cached checkpoint and the
GPU-build path with QLoRA), with the fields the H200 run reports, and bench/report.py renders them; its random weights
go through the loader's quantise-on-load as a checkpoint's would (the 32B shape's load peak: the NF4 base)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_lora_step_smoke_rows_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv("ARENO_BENCH_CACHE", str(tmp_path / "cache"))
    records = _module("lora_step").main(["--smoke", "--shapes", "0.6b", "--qlora", "--impls", "areno", "--no-save"])
    assert [(r["workload"], r["quantize_base"]) for r in records] == [("G1-lora", "none"), ("G32B-qlora", "nf4")]
    for r in records:
        assert "error" not in r, r
        assert r["lora_rank"] == 32 and r["lora_alpha"] == 64 and r["lora_targets"] == "all-linear"
        assert r["steps"] == 2 and len(r["step_s_all"]) == 2
        assert r["step_s"] == pytest.approx(r["step_s_all"][1], abs=1e-3)
        split = r["rollout_s"] + r["reward_s"] + r["pack_s"] + r["logprob_s"] + r["train_s"] + r["other_s"]
        assert split == pytest.approx(r["step_s"]) and r["rollout_s"] > 0 and r["train_s"] > 0
        assert r["response_len_mean"] > 0 and r["logprob_diff"] < 1e-3  # fp32: rollout and trainer agree
    assert records[1]["build_s"] >= 0 and "build_s" not in records[0]  # weights drawn in place, not read

    report = _module("report")
    env = dict(bench="lora_step", git_sha="abc", time="2026-12-05T06:00:00+00:00", gpu="cpu")
    text = report.render([{**env, **r} for r in records])
    table = text[text.index("## LoRA GRPO step: `bench/lora_step.py`"):]
    assert "| areno | 0.6b | none |" in table and "| areno | 32b-qlora | nf4 |" in table


def test_random_weights_are_quantised_as_they_are_drawn(tmp_path):
    from areno.models import load_model
    from areno.models.qlora import nf4_state, quantizable, quantize_base, quantized_modules

    bench = _module("lora_step")
    path = bench.write_config(tmp_path / "model", bench.SMOKE_BUILT, torch.float32)
    timing = {}
    with bench.random_weights(timing):
        onload = load_model(path, device="cpu", dtype=torch.float32, quantize_base="nf4")
        plain = load_model(path, device="cpu", dtype=torch.float32)
    assert timing["build_s"] >= 0 and set(quantized_modules(onload)) == set(quantizable(onload))
    quantize_base(plain)  # the draws are the same (one generator, parameter order): so are the bytes
    theirs, mine = nf4_state(plain), nf4_state(onload)
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)
    theirs, mine = dict(plain.named_parameters()), dict(onload.named_parameters())
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)
