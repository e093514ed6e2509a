"""areno.distributed.launch: the ranks get one OpenMP thread each (torchrun's default) without torchrun's banner
about it, and a value the user set is kept."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from areno.distributed.launch import launch
sys.exit(launch("tests.distributed.omp_rank", [], 2))
"""


def _launch(tmp_path, **env):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")} | env
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["OMP_REPORT"] = str(tmp_path / "omp")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = sorted(p.read_text() for p in tmp_path.glob("omp.*"))
    return proc.stdout + proc.stderr, seen


def test_ranks_get_one_thread_without_the_banner(tmp_path):
    out, seen = _launch(tmp_path)
    assert seen == ["1", "1"]
    assert "OMP_NUM_THREADS" not in out and "*****" not in out, out


def test_the_users_thread_count_is_kept(tmp_path):
    out, seen = _launch(tmp_path, OMP_NUM_THREADS="3")
    assert seen == ["3", "3"] and "OMP_NUM_THREADS" not in out, out
