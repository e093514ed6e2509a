"""Weight gradients of the training linears on a side CUDA stream (``ARENO_WGRAD_STREAM=1``; off by default: an
experiment awaiting its GPU measurement, see bench/RESULTS.md T1/T2).

A linear's backward is two GEMMs: ``dX = dY W`` (the rest of the backward waits for it) and ``dW = dY^T X`` (nothing
in the backward reads it). With this on, ``Linear`` (no tensor parallelism, no bias, no hooks on its weight) runs
``SideWgradLinear``: its backward returns dX on the current stream and queues dW on a per-device side stream, added
into ``weight.grad`` there (assigned when None, ``addmm_`` otherwise: fp32 accumulation, one rounding), so the
memory-bound kernels that follow in the backward (SiLU, the norms, the attention delta) can run under it. The autograd
engine sees no weight gradient (it returns None for the weight), so hooks on the weight would not fire: such weights
keep the plain path.

Ordering: each dW waits on the current stream first (dY and X ready, an earlier zeroing of the gradient done); at
most ``WINDOW`` dW GEMMs are in flight: queuing one more makes the current stream wait for the oldest, whose inputs
are then released (so freeing them cannot hand their memory to a kernel while the side stream still reads it, and the
backward's memory peak grows by at most ``WINDOW`` inputs). ``join()`` makes the current stream wait for the side
stream: the trainer calls it after every backward (inside a CUDA graph capture too), before anything reads a
gradient. Without CUDA (CPU) the dW GEMM runs inline, same accumulation.
"""

from __future__ import annotations

import os
from collections import deque

import torch
import torch.nn.functional as F

WINDOW = 2  # dW GEMMs in flight on the side stream at most
_queues: dict[torch.device, _Queue] = {}


def enabled() -> bool:
    """``ARENO_WGRAD_STREAM``: "0" (default) or "1"; anything else raises."""
    v = os.environ.get("ARENO_WGRAD_STREAM", "0").strip() or "0"
    if v not in ("0", "1"):
        raise ValueError(f"ARENO_WGRAD_STREAM must be 0 or 1, got {v!r}")
    return v == "1"


class _Queue:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.inflight: deque = deque()  # (done event, tensors the GEMM reads)


def _key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _queue(device) -> _Queue:
    key = _key(device)
    q = _queues.get(key)
    if q is None:
        q = _queues[key] = _Queue(key)
    return q


def _add_weight_grad(weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    if weight.grad is None:
        weight.grad = dy.t().mm(x)
    else:
        weight.grad.addmm_(dy.t(), x)


def queue_weight_grad(weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """``weight.grad += dy^T x`` (dy [M, N], x [M, K]) on the side stream (inline without CUDA)."""
    q = _queue(weight.device)
    if q.stream is None:
        _add_weight_grad(weight, dy, x)
        return
    main = torch.cuda.current_stream(weight.device)
    q.stream.wait_stream(main)
    with torch.cuda.stream(q.stream):
        _add_weight_grad(weight, dy, x)
        done = torch.cuda.Event()
        done.record(q.stream)
    q.inflight.append((done, dy, x))
    while len(q.inflight) > WINDOW:
        main.wait_event(q.inflight.popleft()[0])


def join(device=None) -> None:
    """The current stream waits for every queued weight gradient (of ``device``, or of every device)."""
    queues = list(_queues.values()) if device is None else [_queues.get(_key(device))]
    for q in queues:
        if q is None or not q.inflight:
            continue
        torch.cuda.current_stream(q.device).wait_stream(q.stream)
        q.inflight.clear()


class SideWgradLinear(torch.autograd.Function):
    """``F.linear(x, weight)`` whose weight gradient goes through ``queue_weight_grad`` (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x)
        # the parameter itself, not a saved copy: its .grad is written, and activation checkpointing unpacks saved
        # tensors as new objects (recomputed), whose .grad would be lost
        ctx.weight = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        (x,), weight = ctx.saved_tensors, ctx.weight
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            n, k = weight.shape
            queue_weight_grad(weight, dy.reshape(-1, n), x.reshape(-1, k))
        return dx, None


def applies(x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    """Whether a training linear takes the side-stream path: enabled, gradients wanted, no bias, no hooks."""
    return (bias is None and torch.is_grad_enabled() and weight.requires_grad and not weight._backward_hooks
            and enabled())
