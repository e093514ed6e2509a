"""The one rule that picks Triton or native PyTorch for every kernel in areno.kernels.

- ``ARENO_KERNELS=native`` forces the native PyTorch path, ``ARENO_KERNELS=triton`` forces Triton
  (on CPU tensors that needs ``TRITON_INTERPRET=1``, set before triton is imported).
- Unset: Triton for CUDA tensors, and for CPU tensors when ``TRITON_INTERPRET=1``; native otherwise.
- ``ARENO_AUTOTUNE=off`` gives every autotuned kernel only the first config of its candidate list (the measured best
  where a list was swept): nothing is benchmarked and one variant per kernel compiles, for GPU correctness runs on a
  fresh machine. ``on`` (the default) autotunes over every candidate. Read when a kernel's autotuner is built (at
  import for most kernels).

Each kernel's public function calls :func:`use_triton` once with its tensors and a flag saying whether its
Triton path supports the shape/dtype at hand. Nothing else switches kernels: these are the only two environment
variables the kernels read, both here (``ARENO_KERNELS`` at each dispatch, since the test suite and the install-time
warm-up switch it at run time; ``ARENO_AUTOTUNE`` when an autotuner is built). Within the Triton path a family's
variant is its measured default for the GPU; benchmarks pass others as private keyword arguments (docs/kernels.md).
``--attn-backend native`` reaches attention as ``backend="native"``; ``flash`` (the default) follows this rule.
"""

from __future__ import annotations

import functools
import os

import torch

from areno.config.env import env_value


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_mode() -> str:
    mode = (env_value("ARENO_KERNELS") or "auto").strip().lower() or "auto"
    if mode not in ("auto", "native", "triton"):
        raise ValueError(f"ARENO_KERNELS must be 'native', 'triton' or unset, got {mode!r}")
    return mode


def use_triton(*tensors: torch.Tensor, supported: bool = True) -> bool:
    """True when the Triton path should run for these tensors (see the module docstring)."""
    mode = kernel_mode()
    if mode == "native":
        return False
    on_cuda = all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor))
    runnable = triton_available() and (on_cuda or interpreting())
    if mode == "triton":
        if not runnable:
            raise RuntimeError(
                "ARENO_KERNELS=triton but Triton cannot run here: it needs CUDA tensors, "
                "or TRITON_INTERPRET=1 set before triton is imported"
            )
        if not supported:
            raise RuntimeError("ARENO_KERNELS=triton but the Triton kernel does not support these shapes/dtypes")
        return True
    return runnable and supported


def autotune_candidates(configs) -> list:
    """The configs an autotuner gets (``ARENO_AUTOTUNE``, module docstring)."""
    mode = (env_value("ARENO_AUTOTUNE") or "on").strip().lower() or "on"
    if mode not in ("on", "off"):
        raise ValueError(f"ARENO_AUTOTUNE must be 'on', 'off' or unset, got {mode!r}")
    configs = list(configs)
    return configs if mode == "on" else configs[:1]


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as a 2-D ``[rows, K]`` tensor with unit last stride (a view where it can be), for the kernels
    that take row-major 2-D inputs."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
