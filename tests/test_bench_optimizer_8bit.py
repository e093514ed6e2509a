"""bench/optimizer_8bit.py on the CPU (times meaningless): the kernel part's tile rows and the step rows' tile, and a
malformed --tiles refused naming the flag."""

import subprocess
import sys
from pathlib import Path

from areno.kernels.adamw8bit import TILE

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, "bench/optimizer_8bit.py", "--smoke", "--no-save", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_kernel_rows_per_tile_and_the_step_rows_name_theirs():
    out = run("--parts", "step,kernel", "--tiles", "8x8,2x8")
    assert out.returncode == 0, out.stderr[-2000:]
    table = [line.split() for line in out.stdout.splitlines()]
    kernel = [r for r in table if r and r[0] == "kernel"]
    assert [(r[1], r[2]) for r in kernel] == [("8bit", "8x8"), ("8bit", "2x8")]
    assert all(float(r[4]) > 0 for r in kernel)  # ms
    steps = [r for r in table if r and r[0] == "step"]
    assert sorted((r[1], r[2]) for r in steps) == [("8bit", "bucketed"), ("8bit", "fused"), ("fp32", "bucketed"),
                                                   ("fp32", "fused")]
    default = f"{TILE['rows']}x{TILE['num_warps']}"  # the module's tile, put back after the sweep
    assert all(r[3] == default for r in steps if r[1] == "8bit")


def test_a_malformed_tile_is_refused_naming_the_flag():
    for tiles in ("8by8", "3x8"):  # not ROWSxWARPS; 3 rows (a tl.arange's length must be a power of two)
        out = run("--parts", "kernel", "--tiles", tiles)
        assert out.returncode == 2 and "--tiles" in out.stderr, (tiles, out.stderr[-500:])
    out = run("--parts", "kernel,speed")
    assert out.returncode == 2 and "--parts" in out.stderr
    out = run("--parts", "step", "--tiles", "2x8")  # tiles without the part that sweeps them
    assert out.returncode == 2 and "--tiles" in out.stderr
