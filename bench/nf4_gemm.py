"""NF4 GEMM (QLoRA's base projections): areno's ``nf4_matmul`` (``triton``: what QLoRA calls, the fused GEMM up to
``FUSED_MAX_ROWS`` rows and the dequantising pass above; ``fused``: the Triton GEMM that dequantises NF4 in its
prologue; ``planes`` / ``planes 4 warps``: the same GEMM reading int32 words, one nibble plane at a time (128 registers
a thread on sm_90 where ``fused`` takes ~250), fused_config's tiles / on 4 warps past 16 rows; ``fused 1 block`` /
``fused 4 blocks`` / ``fused no split`` / ``fused 16-row tiles``: its config with 1 or 4 NF4 blocks a step (2 and 1
alike take ~250 registers a thread on sm_90: 2 programs an SM) / without split-K / with 16-row tiles on 4 warps past 16
rows (each tile dequantises the weight again); ``triton dequant``: W' written by the one-pass Triton dequantisation,
then cuBLAS) vs the baseline that dequantises the whole weight (native ``dequantize_nf4``) then runs cuBLAS
``F.linear``, in the same process.

    python bench/nf4_gemm.py                              # H200: the shapes below, forward and input gradient
    TRITON_INTERPRET=1 python bench/nf4_gemm.py --smoke   # CPU: tiny shapes, checks the script (times meaningless)

Shapes: y = x @ W'^T with W [N, K] in NF4 (block 64, double-quantised scales), x [M, K] bf16: 4096 x 4096 (an 8B model's
attention projection), Qwen3-32B's gate_up (5120 -> 2 x 25600) and down (25600 -> 5120), M in 1, 2, 4, 8, 16, 32, 64,
127, 256, 2048, 8192 (decode to training microbatches; the fused rows below 128 only); ``dx`` is the backward's input
gradient dy @ W' (trans: always the dequantising pass, no fused row). Also bf16 ``F.linear`` on the unquantised weight
for reference (the time QLoRA trades for 3.9x less weight memory).
Timing: ``common.gpu_time_ms`` (CUDA events, median), eager (``ms``) and replayed from a CUDA graph (``graph_ms``: as
the rollout's decode graphs run it); each line records the max abs error of Triton vs the baseline.
One JSON line per (shape, M, path, op) to bench/results/nf4_gemm.jsonl.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import gemm_row, weight_gemm_bench  # noqa: E402

from areno.kernels.nf4 import dequantize_nf4, fused_config, nf4_matmul, quantize_nf4  # noqa: E402

SHAPES = [("4096x4096", 4096, 4096), ("32b_gate_up", 5120, 51200), ("32b_down", 25600, 5120)]  # (name, K, N)
MS = [1, 2, 4, 8, 16, 32, 64, 127, 256, 2048, 8192]
FUSED_MAX_M = 128  # fused rows below this many rows only
SMOKE_SHAPES, SMOKE_MS = [("smoke", 128, 80)], [3, 17]  # K % 64 == 0: the fused GEMM's blocks


def measure(name: str, w: torch.Tensor, q, m: int, cuda: bool) -> list[dict]:
    """One (shape, M): forward and input gradient, each path, timed and checked against the baseline."""
    n, k = w.shape
    x = torch.randn(m, k, device=w.device, dtype=w.dtype)
    dy = torch.randn(m, n, device=w.device, dtype=w.dtype)
    bm, bn, blocks, split, warps, stages = fused_config(m, n, k)

    def variant(blocks=blocks, split=split, bm=bm, warps=warps):  # the fused GEMM's config with fields changed
        return bm, bn, blocks, split, warps, stages

    ops = {
        ("fwd", "triton"): lambda: nf4_matmul(x, q),
        ("fwd", "fused"): lambda: nf4_matmul(x, q, _path="fused"),
        ("fwd", "fused 1 block"): lambda: nf4_matmul(x, q, _path="fused", _cfg=variant(blocks=1)),
        ("fwd", "fused 4 blocks"): lambda: nf4_matmul(x, q, _path="fused", _cfg=variant(blocks=4)),
        ("fwd", "fused no split"): lambda: nf4_matmul(x, q, _path="fused", _cfg=variant(split=1)),
        ("fwd", "fused 16-row tiles"): lambda: nf4_matmul(x, q, _path="fused", _cfg=variant(bm=16, warps=4)),
        ("fwd", "planes"): lambda: nf4_matmul(x, q, _path="planes"),
        ("fwd", "planes 4 warps"): lambda: nf4_matmul(x, q, _path="planes", _cfg=variant(warps=4)),
        ("fwd", "triton dequant"): lambda: nf4_matmul(x, q, _path="dequant"),
        ("fwd", "dequant+linear"): lambda: F.linear(x, dequantize_nf4(q, w.dtype)),
        ("fwd", "bf16 linear"): lambda: F.linear(x, w),
        ("dx", "triton"): lambda: nf4_matmul(dy, q, trans=True),
        ("dx", "triton dequant"): lambda: nf4_matmul(dy, q, trans=True, _path="dequant"),
        ("dx", "dequant+linear"): lambda: dy @ dequantize_nf4(q, w.dtype),
        ("dx", "bf16 linear"): lambda: dy @ w,
    }
    if m >= FUSED_MAX_M:  # the fused GEMMs are for decode's rows (hundreds of ms a call at 8192)
        ops = {key: fn for key, fn in ops.items() if not key[1].startswith(("fused", "planes"))}
    if bm == 16:  # fused_config's own tile (16 rows, 4 warps) already
        ops.pop(("fwd", "fused 16-row tiles"), None)
        ops.pop(("fwd", "planes 4 warps"), None)
    ref = {op: ops[(op, "dequant+linear")]().float() for op in ("fwd", "dx")}
    return [gemm_row(fn, ref[op], cuda, m, n, k, shape=name, op=op, path=path,
                     weight_mb=round((q.nbytes() if path != "bf16 linear" else w.numel() * 2) / 2**20, 2))
            for (op, path), fn in ops.items()]  # fmt: skip


def main() -> None:
    weight_gemm_bench("nf4_gemm", __doc__, SHAPES, MS, SMOKE_SHAPES, SMOKE_MS, quantize_nf4, measure,
                      ["shape", "M", "op", "path", "ms", "graph_ms", "tflops", "max_abs_err", "weight_mb"])


if __name__ == "__main__":
    main()
