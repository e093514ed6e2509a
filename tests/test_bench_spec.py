"""bench/spec.py (bench/rollout.py --speculative-tokens) on the CPU: how far speculation's greedy answers follow the
plain engine's (``agreement``), and a smoke run of ``--mtp-fit-rounds 2``: the refit round records its accept length
and agreement, and the timed speculative rows carry theirs."""

import importlib
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
def test_fit_rounds_smoke_records_each_round():
    out = subprocess.run([sys.executable, "bench/rollout.py", "--smoke", "--speculative-tokens", "2", "--workloads",
                          "R3", "--spec-greedy", "--mtp-train-steps", "20", "--mtp-fit-rounds", "2", "--no-save"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MTP fit round 1: before it {'spec_accept_len'" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("{'impl': 'areno'")]
    spec = [r for r in rows if "'speculative_tokens': 2" in r]
    assert len(rows) == 4 and len(spec) == 2
    assert all("'greedy_same'" in r and "'mtp_fit_rounds': 2" in r for r in spec)


def test_fit_rounds_without_a_draft_to_fit_is_refused():
    out = subprocess.run([sys.executable, "bench/rollout.py", "--smoke", "--workloads", "R3", "--mtp-fit-rounds", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--mtp-fit-rounds" in out.stderr, out.stderr[-2000:]
