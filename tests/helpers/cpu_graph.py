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


def use_cpu_graphs(runner, monkeypatch, buckets=(4, 8)) -> None:
    """Route ``runner``'s decode through the graph path with these buckets, each "captured" as a ``CpuGraph``."""
    runner.use_graphs, runner.graph_buckets = True, list(buckets)

    def capture(bsz, k, width=0, rope_off=False):
        buf = runner._graph_buffers(bsz, width)
        graph = CpuGraph(runner, buf, k)
        runner.graphs[(bsz, k, width)] = (graph, buf, graph.out)

    monkeypatch.setattr(runner, "_capture", capture)
