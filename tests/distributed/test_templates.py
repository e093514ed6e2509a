"""examples/launch/: each template rendered with sample values gives an `areno train` command line that areno
accepts, whose ranks fill the nodes the template asks for, and whose launcher environment (as Slurm, Kubeflow's
training operator and SkyPilot set it) places every node. YAML structure is checked here against the keys each
tool requires (kubeconform and SkyPilot's own schema are not installable offline, so their schemas are not run)."""

import os
import shlex
import string
import subprocess
from pathlib import Path

import yaml

from areno.cli import make_parser
from areno.config import TrainConfig
from areno.config.applies import check_given
from areno.distributed.cluster import place

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "examples" / "launch"


def config_of(argv: list[str]) -> TrainConfig:
    """The config `areno train argv` runs (flag checks included; the model is not looked up)."""
    assert argv[0] == "train", argv
    # sample values: the image's checkout (/workspace/areno) and a relative path are this checkout
    argv = [str(ROOT / a.removeprefix("/workspace/areno/")) if a.startswith(("/workspace/areno/", "examples/"))
            else a for a in argv]
    explicit = make_parser("train", TrainConfig).parse_explicit(argv[1:])
    config = TrainConfig(**explicit)
    check_given(TrainConfig, {k: getattr(config, k) for k in config.__dataclass_fields__}, explicit)
    return config


def ranks(config) -> int:
    return config.world_size + (len(config.rollout_devices) if config.split else 0)


def test_slurm_script_renders_the_split_run_over_its_nodes(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$SRUN_ARGV"\n')
    (fake / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", SRUN_ARGV=str(tmp_path / "argv"),
               SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="4", TRAIN_NODES="3", GPUS_PER_NODE="8",
               ARENO_ARGS="--max-steps 5 --lr 1e-6")
    subprocess.run(["bash", str(LAUNCH / "slurm.sbatch")], env=env, cwd=ROOT, check=True, timeout=30)
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv[:3] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "areno"]
    config = config_of(argv[3:])
    assert config.train_devices == list(range(24)) and config.rollout_devices == list(range(24, 32))
    assert (config.max_steps, config.lr, config.max_restarts, config.save_path) == (5, 1e-6, 2, "runs/slurm-77")
    directives = [line.split()[1] for line in (LAUNCH / "slurm.sbatch").read_text().splitlines()
                  if line.startswith("#SBATCH")]
    assert "--ntasks-per-node=1" in directives  # one areno (one elastic agent) per node
    srun = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
            "SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "gpu[1-4]", "PATH": "/nonexistent"}
    p = place(config, ranks(config), srun)
    assert (p.nnodes, p.node_rank, p.master_addr) == (4, 3, "gpu1") and ranks(config) // p.nnodes == 8


def test_pytorchjob_manifest_places_each_pod():
    job = yaml.safe_load((LAUNCH / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob") and job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    pods = sum(s["replicas"] for s in specs.values())
    nproc = job["spec"]["nprocPerNode"]
    assert isinstance(nproc, str)  # the CRD's type (an int or "auto"/"gpu" as a string)
    for spec in specs.values():
        assert spec["restartPolicy"] in ("OnFailure", "Never", "Always", "ExitCode")
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch" and container["image"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(nproc)
        mounts = {m["name"] for m in container["volumeMounts"]}
        assert mounts <= {v["name"] for v in spec["template"]["spec"]["volumes"]}
        config = config_of(container["command"][1:] + container["args"])
        assert ranks(config) == pods * int(nproc)
    for pod in range(pods):  # the operator's environment of each pod
        env = {"MASTER_ADDR": "areno-grpo-master-0", "MASTER_PORT": "23456", "RANK": str(pod),
               "WORLD_SIZE": str(pods * int(nproc)), "PET_NNODES": str(pods), "PET_NPROC_PER_NODE": nproc}
        p = place(config, ranks(config), env)
        assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (pods, pod, "areno-grpo-master-0", 23456)


def test_skypilot_task_places_each_node():
    task = yaml.safe_load((LAUNCH / "skypilot.yaml").read_text())
    assert set(task) <= {"name", "num_nodes", "resources", "envs", "workdir", "file_mounts", "setup", "run"}
    gpus = int(task["resources"]["accelerators"].split(":")[1])
    run = string.Template(task["run"].replace("\\\n", " ")).substitute(task["envs"])
    config = config_of(shlex.split(run)[1:])
    assert ranks(config) == task["num_nodes"] * gpus
    assert config.ckpt == task["envs"]["MODEL"] and config.save_path == task["envs"]["SAVE"]
    ips = "\n".join(f"10.0.0.{i + 5}" for i in range(task["num_nodes"]))
    for node in range(task["num_nodes"]):
        env = {"SKYPILOT_NODE_IPS": ips, "SKYPILOT_NODE_RANK": str(node), "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus)}
        p = place(config, ranks(config), env)
        assert (p.nnodes, p.node_rank, p.master_addr) == (task["num_nodes"], node, "10.0.0.5")
