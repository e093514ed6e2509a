"""Process groups: the one place areno's torch.distributed groups come from.

Ranks are laid out TP-major: the ``tp_size`` consecutive ranks ``[k*tp, (k+1)*tp)`` form tensor-parallel group ``k``,
and ranks with the same TP rank form a data-parallel group. ``init_distributed`` reads the torchrun environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); NCCL on GPUs, gloo on CPU.
Without an initialised process group every getter answers as a single process (groups ``None``, rank 0, size 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

_TP_GROUP = None
_DP_GROUP = None
_TP_SIZE = 1


def env_rank(name: str = "RANK") -> int:
    """This process's place in torchrun's launch (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``),
    read before any process group exists; a process that was not launched is rank 0 of 1."""
    default = "1" if name.endswith("WORLD_SIZE") else "0"
    if name == "LOCAL_WORLD_SIZE":
        return int(os.environ.get(name, os.environ.get("WORLD_SIZE", default)))
    return int(os.environ.get(name, default))


def single_node() -> bool:
    """Every rank of the launch runs on this machine."""
    return env_rank("LOCAL_WORLD_SIZE") == env_rank("WORLD_SIZE")


def restart_store() -> dict:
    """After torch's agent restarted the ranks (``--max-restarts``): the agent's store, under a prefix of this
    attempt. The agent keeps one store across attempts, and gloo would otherwise read the dead attempt's rank
    addresses from it (connection refused). Empty (the default env:// store) on the first attempt."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if not attempt or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return {"store": dist.PrefixStore(f"areno/attempt-{attempt}", store)}


def init_distributed(backend: str | None = None, tp_size: int = 1, timeout=None, device: int | None = None) -> None:
    """Initialise the default group from torchrun env vars (once) and build the TP/DP groups for ``tp_size``.

    ``timeout`` (a timedelta) bounds every collective; a server's followers wait on rank 0 for as long as it idles.
    ``device`` is this rank's GPU (``--train-devices``); by default its ``LOCAL_RANK``.
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(device if device is not None else env_rank("LOCAL_RANK"))
        dist.init_process_group(
            backend=backend,
            rank=env_rank("RANK"),
            world_size=env_rank("WORLD_SIZE"),
            **({"timeout": timeout} if timeout is not None else {}),
            **restart_store(),
        )
    if tp_size:
        new_groups(tp_size)


def new_groups(tp_size: int, world: int | None = None):
    """Build (collectively, on every rank) the TP and DP groups for ``tp_size`` over ranks ``[0, world)`` (default:
    all); returns ``(tp_group, dp_group)``, None on a rank outside them."""
    global _TP_GROUP, _DP_GROUP, _TP_SIZE
    rank = dist.get_rank()
    world = world or dist.get_world_size()
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"--tp-size {tp_size} must divide the world size {world}")
    tp_group = dp_group = None
    for k in range(world // tp_size):  # every rank must take part in creating every group
        ranks = list(range(k * tp_size, (k + 1) * tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for r in range(tp_size):
        ranks = list(range(r, world, tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    _TP_GROUP, _DP_GROUP, _TP_SIZE = tp_group, dp_group, tp_size
    return tp_group, dp_group


@dataclass
class SplitLayout:
    """Split mode's world: ranks ``[0, n_train)`` train (TP x DP groups as usual), the rest are rollout ranks, in
    engines of ``rollout_tp_size`` consecutive ranks. ``control`` joins train rank 0 and every rollout rank (commands,
    results); ``publish[p]`` joins the policy publisher ``p`` (the first rank of each train DP replica) and every
    rollout rank (policy buckets)."""

    n_train: int
    rollout_ranks: list[int]
    engines: list[list[int]]
    publishers: list[int]
    train_group: object
    control: object
    publish: dict
    engine_group: object  # this rollout rank's engine TP group (None on train ranks or with rollout TP 1)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def engine_index(self) -> int:
        return next(i for i, ranks in enumerate(self.engines) if self.rank in ranks)


def init_split(n_train: int, tp_size: int, rollout_tp_size: int, device: int | None = None,
               timeout=None) -> SplitLayout:
    """Initialise the world (train ranks first, then rollout ranks) and every split-mode group, collectively."""
    global _TP_GROUP, _DP_GROUP, _TP_SIZE
    init_distributed(tp_size=0, device=device, timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 0 < n_train < world or (world - n_train) % rollout_tp_size:
        raise ValueError(f"a split world of {world} ranks cannot hold {n_train} train ranks and rollout engines of "
                         f"{rollout_tp_size}")
    tp_group, dp_group = new_groups(tp_size, n_train)
    rollout = list(range(n_train, world))
    train_group = dist.new_group(list(range(n_train)))
    control = dist.new_group([0] + rollout)
    engines = [rollout[i : i + rollout_tp_size] for i in range(0, len(rollout), rollout_tp_size)]
    engine_group = None
    for ranks in engines:
        group = dist.new_group(ranks)
        if rank in ranks and rollout_tp_size > 1:
            engine_group = group
    publishers = list(range(0, n_train, tp_size))
    publish = {p: control if p == 0 else dist.new_group([p] + rollout) for p in publishers}
    if rank >= n_train:
        _TP_GROUP, _DP_GROUP, _TP_SIZE = engine_group, None, rollout_tp_size
    return SplitLayout(n_train, rollout, engines, publishers, train_group, control, publish, engine_group)


def rank_device(devices: list[int] | None, index: int, flag: str = "--train-devices") -> int | None:
    """The GPU of the rank at ``index`` of a device list (``--train-devices`` / ``--rollout-devices``) on this node;
    None without CUDA. Across several nodes the lists cannot name another node's GPUs: torchrun's LOCAL_RANK does."""
    if not torch.cuda.is_available():
        return None
    if not single_node():
        return env_rank("LOCAL_RANK")
    device = devices[index] if devices else index
    if device >= torch.cuda.device_count():
        from areno.config import ConfigError

        raise ConfigError(flag, f"names GPU {device}, but this process sees {torch.cuda.device_count()} (after "
                          "CUDA_VISIBLE_DEVICES)")
    return device


def get_tp_group():
    return _TP_GROUP


def get_dp_group():
    return _DP_GROUP


def tp_rank(group=None) -> int:
    group = group if group is not None else _TP_GROUP
    return dist.get_rank(group) if group is not None else 0


def tp_size(group=None) -> int:
    group = group if group is not None else _TP_GROUP
    return dist.get_world_size(group) if group is not None else 1


def is_main_process() -> bool:
    """Global rank 0 (or no distributed run): the one process that writes files and logs."""
    return not dist.is_initialized() or dist.get_rank() == 0


def destroy_distributed() -> None:
    global _TP_GROUP, _DP_GROUP, _TP_SIZE
    _TP_GROUP = _DP_GROUP = None
    _TP_SIZE = 1
    if dist.is_initialized():
        dist.destroy_process_group()
