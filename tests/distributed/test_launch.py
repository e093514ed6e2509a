"""areno.distributed.launch: the ranks get one OpenMP thread each (torchrun's default) without torchrun's banner
about it, and a value the user set is kept; repeated stop signals stop the launcher once; a node that never joins
the rendezvous ends the run after --rdzv-timeout with one line naming the rendezvous."""

import os
import signal
import subprocess
import sys
import time
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


STOP_SCRIPT = """
import sys
from areno.distributed.launch import launch
sys.exit(launch("tests.distributed.stop_rank", [], 2))
"""


def test_repeated_sigterm_stops_the_launcher_once_and_waits_for_the_ranks(tmp_path):
    """A scheduler signals the launcher and the supervisor forwards the same signal: the launcher stops once (exit
    143, no traceback from torch's agent) and the ranks finish their own stop before it exits."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["STOP_REPORT"] = str(tmp_path / "stop")
    proc = subprocess.Popen([sys.executable, "-c", STOP_SCRIPT], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("stop.*.ready"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    for _ in range(6):  # the scheduler's, the supervisor's forward, and a few more while the agent shuts down
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.15)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, out + err
    assert "Traceback" not in err and "Logging error" not in err, err
    assert sorted(p.read_text() for p in tmp_path.glob("stop.[01]")) == ["stopped", "stopped"], err


LONELY_SCRIPT = """
import sys
from areno.distributed.cluster import Placement
from areno.distributed.launch import free_port, launch
port = free_port()
node = Placement("flags", nnodes=2, node_rank=0, master_port=port, join_timeout=3)
sys.exit(launch("tests.distributed.omp_rank", [], 1, placement=node))
"""


def test_a_node_that_never_joins_ends_the_run_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["OMP_REPORT"] = str(tmp_path / "omp")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", LONELY_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("areno:")]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(lines) == 1 and "node 0 of 2 (flags, rendezvous 127.0.0.1:" in lines[0], proc.stderr
    assert "did not all join the rendezvous" in lines[0] and "the run ends here" in lines[0], lines
    assert not list(tmp_path.glob("omp.*"))  # no rank ever started
    assert time.monotonic() - start < 60  # the 3-second join timeout, not torch's 600
