"""bench/spec.py (bench/rollout.py --speculative-tokens) on the CPU: how far speculation's greedy answers follow the
plain engine's (``agreement``), and a smoke run of ``--mtp-fit-rounds 2``: the refit round records its accept length
and agreement, and the timed speculative rows carry theirs."""

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

ROOT = Path(__file__).resolve().parents[1]


def _spec():
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    return importlib.import_module("spec")


def test_agreement_counts_identical_answers_and_where_the_others_leave():
    agreement = _spec().agreement
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    out = agreement(ref, [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]])
    assert out == {"greedy_same": 1 / 3, "first_diff_mean": (4 + 2 + 0) / 3}
    # with the prompts in front (the fit rounds' sequences): indices count from each answer's start
    assert agreement([[7, 7, 1, 2]], [[7, 7, 1, 3]], starts=[2]) == {"greedy_same": 0.0, "first_diff_mean": 1.0}


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(transformers, "Qwen3_5TextConfig"),
                    reason=f"transformers {transformers.__version__} has no qwen3_5")
def test_fit_rounds_smoke_records_each_round(tmp_path):
    """Then the same command again reuses the fitted draft kept under the bench cache (this test's own): the same
    accept lengths without fitting, the rows marked ``mtp_fit_cached``."""
    cmd = [sys.executable, "bench/rollout.py", "--smoke", "--speculative-tokens", "2", "--workloads", "R3",
           "--spec-greedy", "--mtp-train-steps", "20", "--mtp-fit-rounds", "2", "--no-save"]
    env = {**os.environ, "ARENO_BENCH_CACHE": str(tmp_path)}
    rows = []
    for extra in ([], ["--spec-plain-after"]):  # the second run: the plain engine before and after speculation
        out = subprocess.run(cmd + extra, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        rows.append([ast.literal_eval(line) for line in out.stdout.splitlines() if line.startswith("{'impl': 'areno'")])
        assert ("MTP fit round 1: before it {'spec_accept_len'" in out.stdout) == (len(rows) == 1)
    spec = [r for r in rows[0] if r["speculative_tokens"] == 2]
    assert len(rows[0]) == 4 and len(spec) == 2
    assert all("greedy_same" in r and r["mtp_fit_rounds"] == 2 and r["mtp_rounds"] for r in spec)
    again = [r for r in rows[1] if r["speculative_tokens"] == 2]
    assert [r["spec_accept_len"] for r in again] == [r["spec_accept_len"] for r in spec]
    plain = [r for r in rows[1] if r["speculative_tokens"] == 0]
    assert [(r["plain_pass"], r["call"]) for r in plain] == [("before", "first"), ("before", "warm"),
                                                             ("after", "first"), ("after", "warm")]
    # the speed-up against both plain passes' warm calls (the printed rows round tok/s to 4 decimals)
    num = r"([\d.]+)"
    line = re.search(rf"R3 gate auto: {num} tok/s, {num}x the plain engine's {num} / {num} tok/s", out.stdout)
    tok_s, speedup, before, after = map(float, line.groups())
    assert [tok_s, before, after] == pytest.approx([again[1]["tok_s"], plain[1]["tok_s"], plain[3]["tok_s"]], rel=1e-4)
    assert speedup == pytest.approx(tok_s / ((before + after) / 2), rel=1e-4)
    assert "plain_pass" not in rows[0][0]
    assert all(r["mtp_fit_cached"] and r["mtp_loss_last"] == spec[0]["mtp_loss_last"] for r in again)
    assert len(list((tmp_path / "mtp-fits").glob("*.safetensors"))) == 1
    assert all(r["step_s_verify"] > 0 and r["step_s_single"] > 0 for r in spec)


def test_plain_after_without_speculation_is_refused():
    out = subprocess.run([sys.executable, "bench/rollout.py", "--smoke", "--workloads", "R3", "--spec-plain-after"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--spec-plain-after" in out.stderr, out.stderr[-2000:]


def test_fit_rounds_without_a_draft_to_fit_is_refused():
    out = subprocess.run([sys.executable, "bench/rollout.py", "--smoke", "--workloads", "R3", "--mtp-fit-rounds", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--mtp-fit-rounds" in out.stderr, out.stderr[-2000:]


@pytest.mark.skipif(not hasattr(transformers, "Qwen3_5TextConfig"),
                    reason=f"transformers {transformers.__version__} has no qwen3_5")
def test_batch_sweep_smoke_names_the_batch_that_does_not_fit(tmp_path):
    """``--spec-batch-sweep`` at the smoke shape with a KV budget that holds 16 plain rows but not 16 never-gated
    speculating ones (their stash): rows for batches 1 and 4 of both engines and plain's at 16, speculation's
    16 refused naming --kv-cache-memory, and the crossover line with the break-even accept lengths."""
    cmd = [sys.executable, "bench/rollout.py", "--smoke", "--speculative-tokens", "2", "--spec-batch-sweep",
           "--spec-batches", "1,4,16", "--spec-greedy", "--no-save", "--kv-cache-memory", "200000"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "ARENO_BENCH_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [ast.literal_eval(line) for line in out.stdout.splitlines() if line.startswith("{'impl': 'areno'")]
    assert sorted((r["speculative_tokens"], r["batch"]) for r in rows) == [(0, 1), (0, 4), (0, 16), (2, 1), (2, 4)]
    assert "speculative_tokens 2, batch 16: ConfigError: --kv-cache-memory" in out.stdout
    assert "speculation pays at batch" in out.stdout
    assert "accept length needed to break even by batch: 1: " in out.stdout
