"""areno.distributed.cluster: each launcher's environment (values as Slurm's srun, Kubeflow's PyTorchJob and
SkyPilot set them) maps to the same node placement / torch.distributed.run arguments; flags by hand; conflicts."""

from types import SimpleNamespace

import pytest

from areno.config import ConfigError, TrainConfig
from areno.distributed.cluster import agent_args, detect, expand_hostlist, place


def flags(**kw):
    return SimpleNamespace(**{"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None,
                              "max_restarts": 0, "rdzv_timeout": 600, **kw})


# srun --nodes 2 --ntasks-per-node 1 on node 1 of job 4242 (scontrol is not on this PATH: the list is parsed here)
SLURM_NODE = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
              "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1",
              "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_STEP_NODELIST": "gpu-[07-08]",
              "SLURM_TASKS_PER_NODE": "1(x2)", "PATH": "/nonexistent"}
# srun --nodes 2 --ntasks-per-node 4: task 6 (node 1, local 2)
SLURM_TASK = dict(SLURM_NODE, SLURM_PROCID="6", SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="8", SLURM_LOCALID="2",
                  SLURM_TASKS_PER_NODE="4(x2)", SLURM_NTASKS_PER_NODE="4")
# Kubeflow training-operator, PyTorchJob with nprocPerNode 4, Worker replica 0 (pod index 1)
PYTORCHJOB = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "RANK": "1", "WORLD_SIZE": "8",
              "PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_MASTER_ADDR": "job-master-0",
              "PET_MASTER_PORT": "23456", "PET_NODE_RANK": "1", "PYTHONUNBUFFERED": "1"}
SKYPILOT = {"SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "4", "SKYPILOT_TASK_ID": "sky-2026-12-05-areno"}


def test_hostlists_expand_as_scontrol_prints_them():
    assert expand_hostlist("gpu-[07-09,12],login1") == ["gpu-07", "gpu-08", "gpu-09", "gpu-12", "login1"]
    assert expand_hostlist("n1") == ["n1"] and expand_hostlist("n[1-2]") == ["n1", "n2"]
    assert expand_hostlist("r[1-2]c[3,5]") == ["r1c3", "r1c5", "r2c3", "r2c5"]


def test_slurm_node_level_runs_the_agent_on_each_node():
    p = place(flags(), 8, SLURM_NODE)
    assert (p.launcher, p.nnodes, p.node_rank, p.master_addr, p.master_port) == ("slurm", 2, 1, "gpu-07", 24242)
    assert not p.task_level
    args = agent_args(p, 4, 1, p.master_port)
    assert args[:6] == ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d"]
    assert args[args.index("--rdzv-endpoint") + 1] == "gpu-07:24242" and "--node-rank" in args
    assert args[args.index("--max-restarts") + 1] == "1"


def test_slurm_one_task_per_rank_sets_the_process_group_env():
    p = place(flags(), 8, SLURM_TASK)
    assert p.task_env == {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                          "MASTER_ADDR": "gpu-07", "MASTER_PORT": "24242"}
    with pytest.raises(ConfigError, match="--world-size"):
        place(flags(), 4, SLURM_TASK)
    with pytest.raises(ConfigError, match="--max-restarts"):
        place(flags(max_restarts=1), 8, SLURM_TASK)
    assert place(flags(master_addr="10.1.1.1"), 8, SLURM_TASK).task_env["MASTER_ADDR"] == "10.1.1.1"


def test_a_one_node_step_runs_as_one_node():
    one = dict(SLURM_NODE, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_NNODES="1", SLURM_STEP_NUM_NODES="1",
               SLURM_NODEID="0", SLURM_PROCID="0")
    assert place(flags(), 4, one).launcher == "local"


def test_a_batch_scripts_own_shell_is_no_srun_step():
    assert detect({k: v for k, v in SLURM_NODE.items() if k not in ("SLURM_STEP_ID",)}) is None


def test_pytorchjob_and_skypilot_place_the_same_node():
    job, sky = place(flags(), 8, PYTORCHJOB), place(flags(), 8, SKYPILOT)
    assert (job.nnodes, job.node_rank, job.master_addr, job.master_port) == (2, 1, "job-master-0", 23456)
    assert (sky.nnodes, sky.node_rank, sky.master_addr, sky.master_port) == (2, 1, "10.0.0.5", 29500)
    assert agent_args(job, 4, 0, 1)[:4] == agent_args(sky, 4, 0, 1)[:4] == ["--nnodes", "2", "--nproc-per-node",
                                                                            "4"]
    with pytest.raises(ConfigError, match="nprocPerNode 4"):
        place(flags(), 4, PYTORCHJOB)
    assert detect(dict(PYTORCHJOB, TORCHELASTIC_RUN_ID="x")) is None  # a rank of torch's agent: placed already


def test_flags_by_hand_and_conflicts_with_a_launcher():
    p = place(flags(nnodes=2, node_rank=1, master_addr="node0", master_port=29600, rdzv_timeout=45), 4, {})
    assert (p.launcher, p.nnodes, p.node_rank) == ("flags", 2, 1)
    args = agent_args(p, 2, 0, 29600)
    assert args[args.index("--rdzv-conf") + 1] == "join_timeout=45"  # --rdzv-timeout reaches torch's rendezvous
    assert agent_args(p, 2, 0, p.master_port)[agent_args(p, 2, 0, 1).index("--rdzv-endpoint") + 1] == "node0:29600"
    assert place(flags(), 2, {}).launcher == "local"
    with pytest.raises(ConfigError, match="--nnodes 3 conflicts with slurm's 2"):
        place(flags(nnodes=3), 8, SLURM_NODE)
    with pytest.raises(ConfigError, match="--node-rank"):
        place(flags(node_rank=0), 8, SKYPILOT)
    with pytest.raises(ConfigError, match="--master-addr"):
        place(flags(master_addr="elsewhere"), 8, PYTORCHJOB)
    assert place(flags(nnodes=2), 8, SLURM_NODE).nnodes == 2  # the launcher's own value is accepted
    with pytest.raises(ConfigError, match="do not divide over 2 nodes"):
        place(flags(nnodes=2), 3, {})


def test_flag_checks():
    base = {"ckpt": "x", "dataset_path": "d", "algo": "sft"}
    with pytest.raises(ConfigError, match="--node-rank"):
        TrainConfig(**base, nnodes=2, node_rank=2)
    with pytest.raises(ConfigError, match="--max-restarts"):
        TrainConfig(**base, max_restarts=1)  # needs --save-path
    with pytest.raises(ConfigError, match="--master-addr"):
        TrainConfig(**base, master_addr="h")  # one node: nothing to reach
    with pytest.raises(ConfigError, match="--save-interval-minutes"):
        TrainConfig(**base, save_interval_minutes=-1, save_path="s")
