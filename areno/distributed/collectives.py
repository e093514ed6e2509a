"""The collective helpers every module shares: group size/rank, summing numbers, gathering and broadcasting objects.

Each treats ``group=None`` or a run without ``torch.distributed`` (one process) as a group of one, so callers need
no single-process branch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in ``group`` (1 without a group or outside a distributed run)."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def group_rank(group) -> int:
    """This process's rank in ``group`` (0 without a group or outside a distributed run)."""
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def all_sum(values: list[float], group) -> list[float]:
    """``values`` summed element-wise over the ranks of ``group`` (float64, on the GPU where there is one)."""
    if group_size(group) == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, group=group)
    return t.tolist()


def gather_objects(obj, group) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of ``group``."""
    if group_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, group, src: int = 0):
    """``obj`` of global rank ``src`` on every rank of ``group`` (the other ranks' ``obj`` is ignored)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
