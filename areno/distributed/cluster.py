"""Where this node sits in a multi-node run: Slurm (srun), Kubeflow's PyTorchJob, SkyPilot, or flags given by hand.

Each launcher's environment maps to one ``Placement``: either node-level (this process is one node's ``areno
train``; it starts torch's elastic agent with ``--nnodes``, this node's rank and the c10d rendezvous on node 0), or
task-level (Slurm started one task per rank: the process-group env ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` is set from ``SLURM_*`` and no launcher runs). A process that torch's agent started
(``TORCHELASTIC_RUN_ID``) is a rank already and places nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace

from areno.config.fields import ConfigError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Placement:
    """``launcher``: slurm, pytorchjob, skypilot, flags (--nnodes by hand) or local (one node)."""

    launcher: str
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one node: a free port
    nproc_per_node: int | None = None  # the launcher's ranks per node, where it says
    task_env: dict = field(default_factory=dict)  # task-level: the process-group env of this rank
    join_timeout: int = 600  # seconds the nodes have to (re)join the rendezvous (--rdzv-timeout)

    @property
    def task_level(self) -> bool:
        return bool(self.task_env)

    def describe(self) -> str:
        return f"node {self.node_rank} of {self.nnodes} ({self.launcher}, rendezvous {self.master_addr}:" \
               f"{self.master_port})"


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names: ``gpu-[01-03,7],login1`` -> gpu-01 gpu-02 gpu-03 gpu-7 login1
    (zero padding kept, as ``scontrol show hostnames`` prints them)."""
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        parts = re.split(r"\[([^\]]*)\]", item)
        names = [""]
        for i, part in enumerate(parts):
            if i % 2 == 0:
                names = [n + part for n in names]
                continue
            options = []
            for r in part.split(","):
                lo, _, hi = r.partition("-")
                options += [str(k).zfill(len(lo)) for k in range(int(lo), int(hi or lo) + 1)] if hi else [lo]
            names = [n + o for n in names for o in options]
        hosts += names
    return hosts


def slurm_hosts(nodelist: str) -> list[str]:
    """The step's hosts, from ``scontrol show hostnames`` where Slurm's tools are on PATH, else parsed here."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_hostlist(nodelist)


def _int(env, *names, default=None):
    for name in names:
        if env.get(name, "") != "":
            value = env[name].split(":")[-1]  # PET_NNODES may be min:max (elastic): the max
            value = value.split("(")[0]  # SLURM_TASKS_PER_NODE: 2(x3)
            try:
                return int(value)
            except ValueError:
                raise ConfigError(name, f"(environment) is not an integer: {env[name]!r}") from None
    return default


def _slurm(env) -> Placement:
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", default=1)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    addr = env.get("MASTER_ADDR") or slurm_hosts(nodelist)[0]
    job = _int(env, "SLURM_JOB_ID", default=0)
    port = _int(env, "MASTER_PORT", default=20000 + job % 20000)  # one job's port; jobs sharing a node differ
    if ntasks == nnodes:  # one task per node: each runs torch's agent for its node's ranks
        return Placement("slurm", nnodes, _int(env, "SLURM_NODEID", default=0), addr, port)
    per_node = ntasks // nnodes if ntasks % nnodes == 0 else _int(env, "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    task_env = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(ntasks), "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
    return Placement("slurm", nnodes, _int(env, "SLURM_NODEID", default=0), addr, port, per_node, task_env)


def _pytorchjob(env) -> Placement:
    return Placement("pytorchjob", _int(env, "PET_NNODES"), _int(env, "PET_NODE_RANK", "RANK", default=0),
                     env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR", "127.0.0.1"),
                     _int(env, "PET_MASTER_PORT", "MASTER_PORT", default=DEFAULT_PORT),
                     _int(env, "PET_NPROC_PER_NODE"))


def _skypilot(env) -> Placement:
    ips = [ip for ip in env["SKYPILOT_NODE_IPS"].split() if ip]
    return Placement("skypilot", len(ips), _int(env, "SKYPILOT_NODE_RANK", default=0), ips[0],
                     _int(env, "MASTER_PORT", default=DEFAULT_PORT), _int(env, "SKYPILOT_NUM_GPUS_PER_NODE"))


def detect(env=None) -> Placement | None:
    """The launcher this process runs under (None: none, or already a rank of torch's agent or of a process-level
    launcher that set ``RANK``/``WORLD_SIZE`` itself)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        return None
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and "SLURM_NTASKS" in env:
        return _slurm(env)  # under srun (a batch script's own shell is no step of many tasks)
    if env.get("PET_NNODES"):
        return _pytorchjob(env)
    if env.get("SKYPILOT_NODE_IPS", "").strip():
        return _skypilot(env)
    return None


def _merge(found: Placement, config) -> Placement:
    """A launcher's placement and the flags: a flag naming a different value than the launcher's is refused."""
    for flag, name in (("--nnodes", "nnodes"), ("--node-rank", "node_rank")):
        given = getattr(config, name)
        if given is not None and given != getattr(found, name):
            raise ConfigError(flag, f"{given} conflicts with {found.launcher}'s {getattr(found, name)} (the "
                              f"launcher places this node; drop the flag)")
    for flag, name in (("--master-addr", "master_addr"), ("--master-port", "master_port")):
        given = getattr(config, name)
        if given is not None and given != getattr(found, name) and found.launcher != "slurm":
            raise ConfigError(flag, f"{given} conflicts with {found.launcher}'s {getattr(found, name)}")
    if found.launcher == "slurm" and (config.master_addr or config.master_port):  # Slurm only derives them
        addr, port = config.master_addr or found.master_addr, config.master_port or found.master_port
        env = dict(found.task_env, MASTER_ADDR=addr, MASTER_PORT=str(port)) if found.task_level else {}
        found = Placement(found.launcher, found.nnodes, found.node_rank, addr, port, found.nproc_per_node, env)
    return found


def place(config, ranks: int, env=None) -> Placement:
    """This node's placement for a run of ``ranks`` processes: the launcher's (checked against the flags), the
    flags' (--nnodes ...), or one node. Refuses ranks that do not divide over the nodes."""
    found = detect(env)
    if found is not None:
        found = _merge(found, config)
    elif (config.nnodes or 1) > 1:
        found = Placement("flags", config.nnodes, config.node_rank or 0, config.master_addr or "127.0.0.1",
                          config.master_port or DEFAULT_PORT)
    else:
        return Placement("local", master_port=config.master_port)
    if found.nnodes == 1 and not found.task_level:  # a one-node step or pod: this node alone, on a free port
        return Placement("local", master_port=config.master_port)
    if found.task_level:
        if int(found.task_env["WORLD_SIZE"]) != ranks:
            raise ConfigError("--world-size", f"the run has {ranks} ranks (train plus rollout), but srun started "
                              f"{found.task_env['WORLD_SIZE']} tasks: start one task per node, or one per rank")
        if config.max_restarts:
            raise ConfigError("--max-restarts", "needs torch's elastic agent: run one srun task per node "
                              "(--ntasks-per-node=1), not one per rank")
        return found
    if ranks % found.nnodes:
        raise ConfigError("--world-size", f"the run has {ranks} ranks (train plus rollout), which do not divide "
                          f"over {found.nnodes} nodes ({found.launcher})")
    if found.nproc_per_node and found.nproc_per_node != ranks // found.nnodes and found.launcher == "pytorchjob":
        raise ConfigError("--world-size", f"the run has {ranks // found.nnodes} ranks per node, but the PyTorchJob "
                          f"sets nprocPerNode {found.nproc_per_node}")
    return replace(found, join_timeout=config.rdzv_timeout)


def agent_args(placement: Placement, nproc: int, max_restarts: int, port: int) -> list[str]:
    """torch.distributed.run's arguments for this node: nodes, ranks per node, restarts, the c10d rendezvous."""
    host = placement.master_addr if placement.nnodes > 1 else "127.0.0.1"
    args = ["--nnodes", str(placement.nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host}:{port}", "--max-restarts", str(max_restarts)]
    if placement.nnodes > 1:
        args += ["--node-rank", str(placement.node_rank), "--rdzv-id", f"areno-{host}-{port}",
                 "--rdzv-conf", f"join_timeout={placement.join_timeout}"]
    return args
