"""A CPU stand-in for CUDA-graph capture: raise at any operation that would break a stream capture on a GPU.

``with capture_guard(): body()`` runs ``body`` (e.g. the rollout engine's decode-step function, on CPU tensors) and
raises :class:`CaptureBreak` naming the operation and the areno line that issued it at the first of:

- a host read of a tensor value: ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)`` (a Python ``if`` on a tensor),
  indexing with a 0-dim integer tensor (PyTorch reads it on the host), ``.tolist()``, ``.numpy()``, ``.cpu()``,
  ``torch.equal``;
- a data-dependent output shape, which syncs to size the output: ``nonzero``, ``masked_select``, boolean-mask
  indexing ``x[mask]`` / ``x[mask] = y``, ``unique``, ``bincount``, ``histc``, ``repeat_interleave`` without
  ``output_size``;
- a tensor made from host data (``torch.tensor``, ``torch.as_tensor``, ``torch.from_numpy``): on a GPU that is a
  pageable host-to-device copy, which capture refuses (and a replay would not redo).

It sees PyTorch operators only: a Triton launch is invisible to it, so run it on the native kernels (on a GPU the
native path is what runs wherever a Triton kernel does not support the dtype or shape), and keep launchers that read
tensor values on the host (grids sized from ``cu_seqlens``) out of the decode path by reading them. Allocations and
in-place writes are fine: a graph's memory pool serves them.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import areno

PACKAGE = os.path.dirname(os.path.realpath(areno.__file__))  # the package's real location

aten = torch.ops.aten


class CaptureBreak(RuntimeError):
    """An operation inside the guarded region would invalidate a CUDA-graph capture."""


_HOST_READS = {"item", "_local_scalar_dense", "is_nonzero", "equal", "allclose"}
_DYNAMIC_SHAPES = {"nonzero", "masked_select", "unique_consecutive", "unique_dim", "_unique", "_unique2", "bincount",
                   "histc"}
_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
_TENSOR_METHODS = {"tolist": "a host read (.tolist())", "numpy": "a host read (.numpy())",
                   "cpu": "a device-to-host copy (.cpu())", "cuda": "a host-to-device copy (.cuda())",
                   "pin_memory": "a host buffer (.pin_memory())"}
_FACTORIES = {torch.tensor: "torch.tensor(host data)", torch.as_tensor: "torch.as_tensor(host data)",
              torch.from_numpy: "torch.from_numpy"}


def _where() -> str:
    """The innermost areno source line of the current stack (the caller that issued the operation)."""
    for frame in reversed(traceback.extract_stack(limit=10_000)[:-2]):  # its own limit: sys.tracebacklimit may be 0
        path = os.path.realpath(frame.filename)
        if path.startswith(PACKAGE + os.sep):  # areno's own code, wherever the checkout and its .venv lie
            return f"areno/{path[len(PACKAGE) + 1:]}:{frame.lineno} ({frame.line})"
    return "outside areno"


def _break(what: str):
    raise CaptureBreak(f"{what} would break CUDA-graph capture, at {_where()}")


class _Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in _FACTORIES and not (args and isinstance(args[0], torch.Tensor)):
            _break(_FACTORIES[func])
        if name in _TENSOR_METHODS and args and isinstance(args[0], torch.Tensor):
            _break(_TENSOR_METHODS[name])
        return func(*args, **kwargs)


class _Operators(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            _break(f"a host read of a tensor value (aten.{name}: .item(), int()/bool() of a tensor, or indexing with a "
                   "0-dim tensor)")
        if name in _DYNAMIC_SHAPES:
            _break(f"a data-dependent shape (aten.{name})")
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            _break("repeat_interleave without output_size")
        if name in _INDEX_OPS and len(args) > 1:
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                _break(f"boolean-mask indexing (aten.{name})")
        return func(*args, **kwargs)


@contextlib.contextmanager
def capture_guard():
    """Raise :class:`CaptureBreak` at the first operation in the block that a CUDA-graph capture would not take."""
    with _Functions(), _Operators():
        yield
