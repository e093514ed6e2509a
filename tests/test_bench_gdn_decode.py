"""bench/gdn_decode.py on the CPU (the Triton kernels interpreted, times meaningless): a smoke run of the tile sweep
with the speculative verify beside each step row, as the GPU session's ``gdn-tiles`` stage runs it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_sweeps_the_step_and_the_verify_per_tile():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "bench/gdn_decode.py", "--smoke", "--verify-tokens", "3", "--bv", "16", "--warps", "1",
           "--no-save"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(("triton ", "triton-verify "))]
    assert sorted((r[0], r[1], r[2]) for r in rows) == [("triton", "1", "bfloat16"), ("triton", "1", "float32"),
                                                        ("triton-verify", "3", "bfloat16"),
                                                        ("triton-verify", "3", "float32")]
    assert "best float32 tile of triton-verify: BV=16 warps=1" in out.stdout


def test_a_verify_of_one_token_is_refused():
    out = subprocess.run([sys.executable, "bench/gdn_decode.py", "--smoke", "--verify-tokens", "1", "--no-save"],
                         cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 2 and "--verify-tokens" in out.stderr
