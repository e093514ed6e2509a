"""bench/spec_host.py on the CPU: a smoke run measures the plain and the speculative engine at each batch, with the
host time of the speculative step split by phase, and refuses bad sizes naming the flag."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_measures_both_engines_at_each_batch():
    out = subprocess.run([sys.executable, "bench/spec_host.py", "--smoke"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(("plain ", "speculative "))]
    assert [(r[0], r[1], r[2]) for r in rows] == [("plain", "1", "0"), ("speculative", "1", "2"), ("plain", "4", "0"),
                                                  ("speculative", "4", "2")]
    for r in rows:  # steps, wall_ms, host_ms: a step's host time is part of its wall time
        steps, wall, host = int(r[3]), float(r[4]), float(r[5])
        assert steps > 0 and 0 < host < wall
    phases = [line for line in out.stdout.splitlines() if line.startswith("batch ")]
    assert len(phases) == 2 and all("(ms a step)" in line for line in phases)
    assert "results:" not in out.stdout  # --smoke saves nothing


def test_smoke_takes_the_sizes_it_is_given():
    out = subprocess.run([sys.executable, "bench/spec_host.py", "--smoke", "--batches", "2", "--new", "5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(("plain ", "speculative "))]
    assert [(r[0], r[1]) for r in rows] == [("plain", "2"), ("speculative", "2")]
    assert int(rows[0][3]) == 5  # the plain engine's steps: one a token (the first is the prefill's)


def test_bad_sizes_are_refused():
    out = subprocess.run([sys.executable, "bench/spec_host.py", "--batches", "0,4"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2 and "--batches" in out.stderr
