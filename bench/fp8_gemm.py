"""FP8 block GEMM (FP8 rollout's projections, issue 41): areno's fp8 paths vs bf16 ``torch.matmul`` on the
unquantised weight vs the baseline that dequantises the whole fp8 weight then multiplies, in the same process.

    python bench/fp8_gemm.py                              # H200: the shapes below
    TRITON_INTERPRET=1 python bench/fp8_gemm.py --smoke   # CPU: tiny shapes, checks the script (times meaningless)

Shapes: y = x @ W'^T, W [N, K] as E4M3 with 128 x 128 block scales, x [M, K] bf16. An 8B dense model (Qwen3-8B:
hidden 4096, qkv 4096 + 2 x 1024, intermediate 12288) and one expert of a 30B-A3B MoE (Qwen3-30B-A3B: hidden 2048,
expert intermediate 768) and Qwen3-0.6B (G1's model: hidden 1024, q 2048, kv 2 x 1024, intermediate 3072); M in 1,
16, 64, 256, 1024, 8192 (decode batches to prefill chunks). ``--shapes 0.6b_qkv,0.6b_o --ms 256``: a subset.
Paths: ``fp8_linear`` (what FP8 rollout calls: the activation quantised per token and 128 columns by its kernel,
then cuBLAS's block-scaled GEMM where it applies, else Triton's), ``triton`` (the same, the Triton GEMM pinned),
``cublas scaled_mm`` (cuBLAS's GEMM alone on pre-quantised x, where torch and the GPU have it), ``triton gemm``
(the Triton GEMM alone on pre-quantised x, default tiles), ``triton gemm best`` (the fastest of a tile sweep, its
``config`` recorded: what ``fp8.fp8_config`` should learn), ``dequant+matmul``
(``dequantize_weight_fp8`` to bf16, then ``torch.matmul``), ``bf16 matmul`` (cuBLAS on the bf16 weight: what FP8
rollout must beat).
Timing: ``common.gpu_time_ms`` (CUDA events, median, L2 flushed), eager (``ms``) and replayed from a CUDA graph
(``graph_ms``: what the rollout's decode graphs see, without the host's launch cost); each row records the max abs
error against the native reference (``fp8_matmul_native``, dequantise then fp32 matmul; the two torch paths multiply
the unquantised x, so theirs includes the activation's quantisation) and the weight bytes read.
One JSON line per (shape, M, path) to bench/results/fp8_gemm.jsonl.
"""

from __future__ import annotations

import itertools
import os
import sys

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import gemm_row, graph_time_ms, weight_gemm_bench  # noqa: E402

from areno.kernels.fp8 import (  # noqa: E402
    cublas_fp8_applies,
    dequantize_weight_fp8,
    fp8_config,
    fp8_linear,
    fp8_matmul,
    fp8_matmul_cublas,
    fp8_matmul_native,
    quantize_act_fp8,
    quantize_act_fp8_cublas,
    quantize_weight_fp8,
)
from areno.kernels.gemm import GemmConfig  # noqa: E402

SHAPES = [  # (name, K, N)
    ("8b_qkv", 4096, 6144), ("8b_o", 4096, 4096), ("8b_gate_up", 4096, 24576), ("8b_down", 12288, 4096),
    ("30b_a3b_expert_gate_up", 2048, 1536), ("30b_a3b_expert_down", 768, 2048),
    ("0.6b_qkv", 1024, 4096), ("0.6b_o", 2048, 1024), ("0.6b_gate_up", 1024, 6144), ("0.6b_down", 3072, 1024),
]  # fmt: skip
MS = [1, 16, 64, 256, 1024, 8192]
SMOKE_SHAPES, SMOKE_MS = [("smoke", 200, 96)], [3, 17]


def measure(name: str, w: torch.Tensor, q, m: int, cuda: bool) -> list[dict]:
    """One (shape, M): every path timed and checked against the native reference."""
    n, k = w.shape
    x = torch.randn(m, k, device=w.device, dtype=w.dtype)
    xq, xs = quantize_act_fp8(x)
    paths = {
        "fp8_linear": (lambda: fp8_linear(x, q), q.nbytes()),
        "triton": (lambda: fp8_linear(x, q, _gemm="triton"), q.nbytes()),
        "triton gemm": (lambda: fp8_matmul(xq, xs, q, out_dtype=w.dtype), q.nbytes()),
        "dequant+matmul": (lambda: torch.matmul(x, dequantize_weight_fp8(q, w.dtype).T), q.nbytes()),
        "bf16 matmul": (lambda: torch.matmul(x, w.T), w.numel() * w.element_size()),
    }
    if cublas_fp8_applies(x, q):  # cuBLAS's block-scaled fp8 GEMM alone, on operands in its layout
        xq4, xs4 = quantize_act_fp8_cublas(x)
        paths["cublas scaled_mm"] = (lambda: fp8_matmul_cublas(xq4, xs4, q, w.dtype, rows=m), q.nbytes())
    elif cuda:
        print(f"cublas scaled_mm: not on this GPU / torch (fp8.cublas_fp8_ready), {name} M={m}", flush=True)
    ref = fp8_matmul_native(xq, xs, q)
    rows = []
    for path, (fn, nbytes) in paths.items():
        row = gemm_row(fn, ref, cuda, m, n, k, shape=name, path=path, weight_mb=round(nbytes / 2**20, 2))
        rows.append({**row, "weight_gb_s": round(nbytes / row["ms"] / 1e6, 1)})
    best, default = None, fp8_config(m, n, k, xq.device)
    for cfg in candidates(m, default, cuda):  # the sweep's eager times pick the best; its graph time taken alone
        row = gemm_row(lambda c=cfg: fp8_matmul(xq, xs, q, out_dtype=w.dtype, config=c), ref, cuda, m, n, k,
                       graph=False, shape=name, path="triton gemm best", config=list(cfg))  # fmt: skip
        best = (row, cfg) if best is None or row["ms"] < best[0]["ms"] else best
    cfg = best[1]
    graphed = graph_time_ms(lambda: fp8_matmul(xq, xs, q, out_dtype=w.dtype, config=cfg), best[0]) if cuda else None
    rows.append({**best[0], "graph_ms": graphed, "default_config": list(default),
                 "weight_mb": round(q.nbytes() / 2**20, 2), "weight_gb_s": round(q.nbytes() / best[0]["ms"] / 1e6, 1)})
    return rows


def candidates(m: int, default: GemmConfig, cuda: bool) -> list[GemmConfig]:
    """The GEMM's tile configs swept per (shape, M) (the fastest is the "triton gemm best" row, beside the default
    config's "triton gemm"): row tiles up to the next power of two of M, 32-128 columns, split-K 1 / 2 / 4 / the
    default's, 3 or 4 stages, 4 warps (8 for 128 x 128 tiles). Two configs in a smoke run."""
    if not cuda:
        return [default, default._replace(block_k=32, split_k=2)]
    rows = [b for b in (16, 64, 128) if b <= max(16, 2 * m)]
    out = {default}
    for bm, bn, split, stages in itertools.product(rows, (32, 64, 128), sorted({1, 2, 4, default.split_k}), (3, 4)):
        if bm * bn <= 64 * 64 or split == 1:  # split-K only where tiles are small (few programs)
            out.add(GemmConfig(bm, bn, 128, split, 8 if bm * bn >= 128 * 128 else 4, stages))
    return sorted(out)


def main() -> None:
    weight_gemm_bench("fp8_gemm", __doc__, SHAPES, MS, SMOKE_SHAPES, SMOKE_MS, quantize_weight_fp8, measure,
                      ["shape", "M", "path", "ms", "graph_ms", "tflops", "weight_gb_s", "max_abs_err", "weight_mb"])


if __name__ == "__main__":
    main()
