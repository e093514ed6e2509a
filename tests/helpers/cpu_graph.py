"""A stand-in for a captured CUDA graph on the CPU, for tests of the engine's graph path without a GPU."""

from __future__ import annotations

import torch


class CpuGraph:
    """``replay()`` runs the runner's captured decode steps again on the same static buffers and writes the same
    output tensors, which is what a graph replay does (tests patch ``ModelRunner._capture`` to build these)."""

    def __init__(self, runner, buf, k):
        self.run = lambda: runner.decode_steps(buf, k)
        self.out = tuple(torch.zeros_like(t) for t in self.run())

    def replay(self):
        for dst, src in zip(self.out, self.run()):
            dst.copy_(src)
