"""A real Slurm on this machine (Debian's slurm-wlm: munged, slurmctld and two slurmd "nodes" n1, n2 on
localhost, started here and stopped after): `sbatch --wait examples/launch/slurm.sbatch` runs a 2-node split-mode
run on gloo (node n1 trains, n2 serves the rollout engine) to completion, and its losses equal the same run's on
one node. Skipped, with the reason, where the daemons are not installed or cannot start (not root, ...)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areno.distributed.launch import free_port
from tests.helpers.split_runs import make_files

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")
RUN_FLAGS = ("--batch-size 4 --n-samples 2 --mini-bs 2 --max-steps 3 --max-new-tokens 6 --lr 1e-3 --no-tensorboard "
             "--dtype float32 --temperature 1.0")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(any(shutil.which(d, path=f"/usr/sbin:{os.environ.get('PATH', '')}") is None
                                     for d in DAEMONS), reason="Slurm (slurm-wlm, munge) is not installed"),
              pytest.mark.skipif(os.geteuid() != 0, reason="slurmd runs jobs as root here: needs root")]

CONF = """ClusterName=areno
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1} CPUs={cpus} RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture
def slurm(tmp_path_factory):
    """A two-node Slurm cluster on localhost; yields the environment its commands need; stops its daemons."""
    d = Path(tmp_path_factory.mktemp("slurm"))
    for sub in ("state", "spool/n1", "spool/n2", "log", "munge"):
        (d / sub).mkdir(parents=True)
    (d / "munge").chmod(0o700)
    key = d / "munge" / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(d=d, ctld=free_port(), slurmd=free_port(), n1=free_port(), n2=free_port(),
                                cpus=os.cpu_count() or 2))
    env = dict(os.environ, SLURM_CONF=str(conf), PATH=f"/usr/sbin:{os.environ['PATH']}")
    pids = [d / "munge" / "pid", d / "slurmctld.pid", d / "slurmd-n1.pid", d / "slurmd-n2.pid"]
    starts = [["munged", "--force", "-S", str(d / "munge" / "socket"), f"--key-file={key}",
               f"--log-file={d}/log/munged.log", f"--pid-file={pids[0]}", f"--seed-file={d}/munge/seed"],
              ["slurmctld", "-f", str(conf)], ["slurmd", "-f", str(conf), "-N", "n1"],
              ["slurmd", "-f", str(conf), "-N", "n2"]]
    try:
        for argv in starts:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            if proc.returncode:
                pytest.skip(f"{argv[0]} cannot start here: {(proc.stderr or proc.stdout).strip()[:300]}")
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                           text=True).stdout:
            if time.monotonic() > deadline:
                pytest.skip("the slurmd nodes did not come up: " + (d / "log" / "slurmctld.log").read_text()[-500:])
            time.sleep(0.5)
        yield env
    finally:
        for path in reversed(pids):  # the daemons this fixture started, by their pid files
            pid = _pid(path)
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


def losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]


def test_sbatch_runs_the_split_template_on_two_nodes(slurm, tmp_path):
    ckpt, data, reward = make_files(tmp_path)  # the split tests' tiny checkpoint, data and reward
    run = dict(slurm, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MODEL=str(ckpt), DATA=str(data),
               REWARD=str(reward), SAVE=str(tmp_path / "slurm"), GPUS_PER_NODE="1", TRAIN_NODES="1",
               ARENO=f"{sys.executable} -m areno", ARENO_ARGS=RUN_FLAGS,
               MASTER_ADDR="127.0.0.1")  # the test's node names (n1, n2) are not host names
    proc = subprocess.run(["sbatch", "--wait", "--gpus-per-node=0", f"--output={tmp_path}/job.out",
                           str(ROOT / "examples" / "launch" / "slurm.sbatch")], env=run, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").is_file() else ""
    assert proc.returncode == 0, proc.stderr + log[-4000:]
    one = subprocess.run([sys.executable, "-m", "areno", "train", "--ckpt", str(ckpt), "--dataset-path", str(data),
                          "--reward-fn-path", str(reward), "--algo", "grpo", "--train-devices", "0",
                          "--rollout-devices", "1", "--save-path", str(tmp_path / "one"), *RUN_FLAGS.split()],
                         env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    got, want = losses(tmp_path / "slurm"), losses(tmp_path / "one")
    assert len(got) == 3 and got == pytest.approx(want, abs=1e-6), (got, want)
