"""bench/lora_step.py --smoke on the CPU: LoRA GRPO rows through areno's train path (the cached checkpoint and the
GPU-build path with QLoRA), with the fields the H200 run reports, and bench/report.py renders them."""

import importlib.util
import sys
from pathlib import Path

import pytest

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
