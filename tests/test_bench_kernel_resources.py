"""bench/kernel_resources.py: Triton kernels compiled for sm_90a on a machine without a GPU, ptxas's report parsed
(a subprocess: the suite interprets Triton, which compiles nothing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_tile_that_fits_has_no_stack_and_one_that_does_not_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "bench/kernel_resources.py", "--kernels", "gdn_step,gdn_verify", "--states", "float32",
           "--tiles", "32x4,128x4", "--no-save"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    table = [line.split() for line in out.stdout.splitlines()]
    rows = {(r[0], r[2]): r for r in table if r and r[0].startswith("gdn_")}
    assert set(rows) == {("gdn_step", "32"), ("gdn_step", "128"), ("gdn_verify", "32"), ("gdn_verify", "128")}
    registers, stack, spill_store = (lambda r: int(r[5]), lambda r: int(r[6]), lambda r: int(r[7]))
    small = rows[("gdn_step", "32")]  # a [128, 32] fp32 state tile in 128 threads fits the registers
    assert small[4] == "sm_90a" and 0 < registers(small) <= 255 and stack(small) == 0
    big = rows[("gdn_verify", "128")]  # a [128, 128] one (the verify holds it across its tokens) spills
    assert stack(big) > 0 and spill_store(big) > 0


def test_the_8bit_adamw_tiles_compile_and_resident_warps_follow_the_registers():
    """The 8-bit AdamW kernel (no state pool) by ROWSxwarps tile: a program of 8 absmax blocks keeps more registers a
    thread than one of 1, and ``resident_warps`` is what the register file allows (64K a multiprocessor, 256 a warp's
    unit, 64 warps and 32 programs at most)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, kernel_resources as k; print(json.dumps([k.resources('adamw8bit', None, r, w, 90) "
            "for r, w in ((8, 8), (1, 4))]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "bench", env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    big, small = json.loads(out.stdout.splitlines()[-1])
    assert (big["rows"], big["num_warps"], small["rows"], small["num_warps"]) == (8, 8, 1, 4)
    assert big["state_dtype"] is None and "BV" not in big and big["arch"] == "sm_90a"
    assert 0 < small["registers"] < big["registers"] <= 255
    for row in (big, small):
        per_warp = -(-row["registers"] * 32 // 256) * 256
        expect = min(65536 // (per_warp * row["num_warps"]), 32, 64 // row["num_warps"]) * row["num_warps"]
        assert row["resident_warps"] == expect and 0 < expect <= 64
