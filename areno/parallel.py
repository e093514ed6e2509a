"""Process groups: the one place areno's torch.distributed groups come from.

Ranks are laid out TP-major: the ``tp_size`` consecutive ranks ``[k*tp, (k+1)*tp)`` form tensor-parallel group ``k``,
and ranks with the same TP rank form a data-parallel group. ``init_distributed`` reads the torchrun environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); NCCL on GPUs, gloo on CPU.
Without an initialised process group every getter answers as a single process (groups ``None``, rank 0, size 1).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

_TP_GROUP = None
_DP_GROUP = None
_TP_SIZE = 1


def init_distributed(backend: str | None = None, tp_size: int = 1, timeout=None, device: int | None = None) -> None:
    """Initialise the default group from torchrun env vars (once) and build the TP/DP groups for ``tp_size``.

    ``timeout`` (a timedelta) bounds every collective; a server's followers wait on rank 0 for as long as it idles.
    ``device`` is this rank's GPU (``--train-devices``); by default its ``LOCAL_RANK``.
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(device if device is not None else int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend=backend,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            **({"timeout": timeout} if timeout is not None else {}),
        )
    new_groups(tp_size)


def new_groups(tp_size: int):
    """Build (collectively, on every rank) the TP and DP groups for ``tp_size``; returns ``(tp_group, dp_group)``."""
    global _TP_GROUP, _DP_GROUP, _TP_SIZE
    world, rank = dist.get_world_size(), dist.get_rank()
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


def get_world_group():
    return dist.group.WORLD if dist.is_initialized() else None


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
