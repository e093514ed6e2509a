"""What the kernels ask of the GPU: its SM count, its compute capability, and whether it has TMA (sm_90+)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (sizes split-K and persistent grids)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def capability(device=None) -> tuple[int, int]:
    """(major, minor) compute capability of ``device`` (default: the current CUDA device)."""
    return torch.cuda.get_device_capability(device)


def has_tma(device=None) -> bool:
    """True on sm_90+ (Hopper and newer): the GPUs with TMA tensor descriptors and wgmma."""
    return capability(device)[0] >= 9
