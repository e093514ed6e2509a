"""NF4 GEMM (QLoRA's base projections): areno's Triton GEMM that dequantises NF4 in its prologue vs the baseline
that dequantises the whole weight (native ``dequantize_nf4``) then runs cuBLAS ``F.linear``, in the same process.

    python bench/nf4_gemm.py                              # H200: the shapes below, forward and input gradient
    TRITON_INTERPRET=1 python bench/nf4_gemm.py --smoke   # CPU: tiny shapes, checks the script (times meaningless)

Shapes: y = x @ W'^T with W [N, K] in NF4 (block 64, double-quantised scales), x [M, K] bf16: 4096 x 4096 (an 8B
model's attention projection), Qwen3-32B's gate_up (5120 -> 2 x 25600) and down (25600 -> 5120), M in 1, 16, 256,
2048, 8192 (decode to training microbatches); ``dx`` is the backward's input gradient dy @ W' (trans). Also bf16
``F.linear`` on the unquantised weight for reference (the time QLoRA trades for 3.9x less weight memory).
Timing: ``common.gpu_time_ms`` (CUDA events, median); each line records the max abs error of Triton vs the baseline.
One JSON line per (shape, M, path, op) to bench/results/nf4_gemm.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402

from areno.kernels.nf4 import dequantize_nf4, nf4_matmul, quantize_nf4  # noqa: E402

SHAPES = [("4096x4096", 4096, 4096), ("32b_gate_up", 5120, 51200), ("32b_down", 25600, 5120)]  # (name, K, N)
MS = [1, 16, 256, 2048, 8192]
SMOKE_SHAPES, SMOKE_MS = [("smoke", 96, 80)], [3, 17]


def _time(fn, cuda: bool) -> float:
    if cuda:
        return gpu_time_ms(fn)
    import time

    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def measure(name: str, w: torch.Tensor, q, m: int, cuda: bool) -> list[dict]:
    """One (shape, M): forward and input gradient, each path, timed and checked against the baseline."""
    n, k = w.shape
    x = torch.randn(m, k, device=w.device, dtype=w.dtype)
    dy = torch.randn(m, n, device=w.device, dtype=w.dtype)
    ops = {
        ("fwd", "triton"): lambda: nf4_matmul(x, q),
        ("fwd", "dequant+linear"): lambda: F.linear(x, dequantize_nf4(q, w.dtype)),
        ("fwd", "bf16 linear"): lambda: F.linear(x, w),
        ("dx", "triton"): lambda: nf4_matmul(dy, q, trans=True),
        ("dx", "dequant+linear"): lambda: dy @ dequantize_nf4(q, w.dtype),
        ("dx", "bf16 linear"): lambda: dy @ w,
    }
    ref = {op: ops[(op, "dequant+linear")]().float() for op in ("fwd", "dx")}
    rows = []
    for (op, path), fn in ops.items():
        err = (fn().float() - ref[op]).abs().max().item()
        ms = _time(fn, cuda)
        rows.append({"shape": name, "K": k, "N": n, "M": m, "op": op, "path": path, "ms": round(ms, 4),
                     "tflops": round(2 * m * n * k / ms / 1e9, 2), "max_abs_err": err,
                     "weight_mb": round((q.nbytes() if path != "bf16 linear" else w.numel() * 2) / 2**20, 2)})
    return rows


def run(shapes, ms, device, dtype) -> list[dict]:
    cuda = device == "cuda"
    rows = []
    for name, k, n in shapes:
        w = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
        q = quantize_nf4(w)
        for m in ms:
            rows += measure(name, w, q, m, cuda)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("bench/nf4_gemm.py needs a CUDA device (or --smoke with TRITON_INTERPRET=1)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = run(SMOKE_SHAPES if args.smoke else SHAPES, SMOKE_MS if args.smoke else MS, device, dtype)
    print_table(rows, ["shape", "M", "op", "path", "ms", "tflops", "max_abs_err", "weight_mb"])
    if not args.smoke:
        print(append_jsonl("nf4_gemm", rows, env_info()))


if __name__ == "__main__":
    main()
