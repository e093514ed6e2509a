"""examples/launch/: each template rendered with sample values gives an `areno train` command line that areno
accepts, whose ranks fill the nodes the template asks for, and whose launcher environment (as Slurm, Kubeflow's
training operator and SkyPilot set it) places every node. The YAML files are validated by their tools' own code:
SkyPilot's task loader (`sky.Task.from_yaml_config`: its JSON schemas for the task, resources and storage, no cloud
credentials or network) and the training operator's SDK models (kubeflow-training's KubeflowOrgV1PyTorchJob with
the Kubernetes pod models, through its ApiClient); a broken copy of each must fail, so the validators are live.
Skipped with the reason where those packages are not installed (`bash scripts/install.sh --test` installs them)."""

import copy
import importlib.util
import json
import os
import shlex
import string
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
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


def kubeflow_sdk_problems(manifest: dict) -> list[str]:
    """What the training operator's SDK rejects in a PyTorchJob manifest: a wrong type or a missing required field
    (its models raise ValueError while deserialising), a key no model has (dropped on the way in) or a value coerced
    to another type (a string field given a number): the last two show as paths where serialising the models back
    differs from the manifest. Kubernetes quantities (resource limits/requests) are int-or-string: 8 is "8"."""
    pytest.importorskip("kubeflow.training", reason="kubeflow-training is not installed (setup.cfg's test extra)")
    from kubeflow.training import ApiClient

    client = ApiClient()
    try:  # the same path as a job read back from the API server
        job = client.deserialize(SimpleNamespace(data=json.dumps(manifest)), "KubeflowOrgV1PyTorchJob")
    except ValueError as e:
        return [str(e)]
    return changed_paths(manifest, client.sanitize_for_serialization(job))


def changed_paths(written, kept, path="$") -> list[str]:
    """Paths of `written` (a manifest) that `kept` (its models serialised back) lost or holds as another value."""
    if isinstance(written, dict):
        if not isinstance(kept, dict):
            return [path]
        return [p for k, v in written.items()
                for p in (changed_paths(v, kept[k], f"{path}.{k}") if k in kept else [f"{path}.{k} (unknown key)"])]
    if isinstance(written, list):
        if not isinstance(kept, list) or len(kept) != len(written):
            return [path]
        return [p for i, (w, k) in enumerate(zip(written, kept)) for p in changed_paths(w, k, f"{path}[{i}]")]
    quantity = ".resources.limits." in path or ".resources.requests." in path
    if type(written) is type(kept) and written == kept or quantity and str(written) == kept:
        return []
    return [f"{path}: {written!r} read as {kept!r}"]


def test_pytorchjob_manifest_is_valid_for_the_training_operators_sdk():
    manifest = yaml.safe_load((LAUNCH / "pytorchjob.yaml").read_text())
    assert kubeflow_sdk_problems(manifest) == []
    from kubeflow.training import ApiClient, KubeflowOrgV1PyTorchJob
    from kubernetes.client import V1PodTemplateSpec

    job = ApiClient().deserialize(SimpleNamespace(data=json.dumps(manifest)), "KubeflowOrgV1PyTorchJob")
    assert isinstance(job, KubeflowOrgV1PyTorchJob) and job.spec.nproc_per_node == "8"
    for spec in job.spec.pytorch_replica_specs.values():
        assert isinstance(spec.template, V1PodTemplateSpec) and spec.template.spec.containers[0].name == "pytorch"

    def broken(edit) -> list[str]:
        copy_ = copy.deepcopy(manifest)
        edit(copy_["spec"])
        return kubeflow_sdk_problems(copy_)

    assert broken(lambda s: s["pytorchReplicaSpecs"]["Worker"].update(replica=1)) == [
        "$.spec.pytorchReplicaSpecs.Worker.replica (unknown key)"]
    assert broken(lambda s: s["runPolicy"].update(backoffLimit="two")) == [
        "invalid literal for int() with base 10: 'two'"]
    assert broken(lambda s: s.update(nprocPerNode=8)) == ["$.spec.nprocPerNode: 8 read as '8'"]
    missing = broken(lambda s: s["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].pop("name"))
    assert len(missing) == 1 and "`name`, must not be `None`" in missing[0]


def skypilot_task(config: dict, envs: dict | None = None):
    """The task SkyPilot's own loader builds from a task YAML (task, resources and storage schemas checked; no cloud
    credentials or network needed); raises ValueError (InvalidSkyPilotConfigError) for an invalid one."""
    if importlib.util.find_spec("sky") is None:
        pytest.skip("skypilot is not installed (bash scripts/install.sh --test adds it, without its dependencies)")
    import sky

    had, limit = hasattr(sys, "tracebacklimit"), getattr(sys, "tracebacklimit", None)
    try:
        return sky.Task.from_yaml_config(copy.deepcopy(config), env_overrides=list((envs or {}).items()))
    finally:  # SkyPilot's error printer sets sys.tracebacklimit = 0 and leaves it when its error propagates, which
        if had:  # empties traceback.extract_stack() for every later test of the session
            sys.tracebacklimit = limit
        elif hasattr(sys, "tracebacklimit"):
            del sys.tracebacklimit


def test_skypilot_task_is_valid_for_skypilot():
    config = yaml.safe_load((LAUNCH / "skypilot.yaml").read_text())
    task = skypilot_task(config, {"MODEL": "Qwen/Qwen3-0.6B"})  # a sample value, as `sky launch --env` gives it
    assert (task.name, task.num_nodes, task.envs["MODEL"], task.envs["SAVE"]) == (
        "areno-grpo", 2, "Qwen/Qwen3-0.6B", "/checkpoints/areno-grpo")
    (resources,) = task.resources
    assert (resources.accelerators, resources.disk_size) == ({"H100": 8}, 512)
    assert task.run.startswith("areno train") and set(task.storage_mounts) == {"/checkpoints"}

    for edit, message in [
        (lambda c: c["resources"].update(accelerator="H100:8"), "did you mean 'accelerators'"),  # unknown key
        (lambda c: c.update(num_nodes="two"), "'two' is not of type 'integer'"),
        (lambda c: c["file_mounts"]["/checkpoints"].update(mode="MOUNTED"), "'MOUNTED' is not one of"),
        (lambda c: c["resources"].update(accelerators="H100:eight"), "<name>:<cnt>"),
    ]:
        copy_ = copy.deepcopy(config)
        edit(copy_)
        with pytest.raises(ValueError, match=message):
            skypilot_task(copy_)
