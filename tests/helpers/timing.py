"""GPU tests' timing: mean milliseconds of a callable on the current CUDA stream (CUDA events; one warm-up call)."""

import torch


def cuda_ms(fn, iters: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
