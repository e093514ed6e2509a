"""Does a row of a decode GEMM depend on how many rows share the call? Speculation's greedy tokens equal plain
decoding's only where a verify (K + 1 rows a sequence) computes each row as a plain step (one row a sequence) does.

    python bench/batch_invariance.py                            # GPU: Qwen3.5-9B's decode projections, bf16
    TRITON_INTERPRET=1 python bench/batch_invariance.py --smoke # CPU: tiny shapes, checks the script

Per projection ``y = x @ W^T`` (x [M, K] bf16 rows of N(0, 1), W [N, K] ~ N(0, 1/K)) and implementation: cuBLAS
(``F.linear``, what ``areno.kernels.gemm.linear`` runs for shapes ``TUNED`` does not list, the 9B's all), areno's
split-K Triton GEMM with ``heuristic_config`` (16-row tiles up to M = 16: its config, so its reduction order, does
not change with M there), and the LM head's fp32-output product (``logits_f32``). ``same_rows``: for each M in 2..8,
whether every row of the M-row product equals, bit for bit, that row computed alone; ``worst_diff``: the largest
difference seen; ``us_m1`` / ``us_m3``: the time of one call at M = 1 and 3 (CUDA events, L2 flushed, median).
One JSON line per (projection, implementation) to bench/results/batch_invariance.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, print_table, time_ms  # noqa: E402

from areno.kernels._device import sm_count  # noqa: E402
from areno.kernels.gemm import gemm_launch, heuristic_config  # noqa: E402
from areno.kernels.sampler import logits_f32  # noqa: E402

# (name, K, N) of Qwen3.5-9B's decode projections (hidden 4096; bench/families.py's shape)
SHAPES = [("attn.qkv_proj", 4096, (2 * 16 + 2 * 4) * 256), ("attn.o_proj", 16 * 256, 4096),
          ("gdn.in_proj", 4096, 2 * 16 * 128 + 2 * 32 * 128 + 2 * 32), ("gdn.out_proj", 32 * 128, 4096),
          ("mlp.gate_up", 4096, 2 * 12288), ("mlp.down", 12288, 4096), ("lm_head", 4096, 248320)]
SMOKE = [("proj", 64, 48), ("lm_head", 64, 96)]


def impls(name: str, cuda: bool):
    """{implementation: fn(x, w) -> y} for one projection."""
    if name == "lm_head":
        return {"logits_f32": logits_f32}
    sms = sm_count(0) if cuda else 132
    return {"cublas": F.linear,
            "triton_heuristic": lambda x, w: gemm_launch(x, w, heuristic_config(x.shape[0], *w.shape, sms))}


def measure(name: str, k: int, n: int, device, dtype, cuda: bool) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
    x = torch.randn(8, k, generator=g, device=device).to(dtype)
    rows = []
    for impl, fn in impls(name, cuda).items():
        alone = torch.cat([fn(x[i : i + 1], w) for i in range(8)])
        same, worst = True, 0.0
        for m in range(2, 9):
            y = fn(x[:m], w)
            same &= torch.equal(y, alone[:m])
            worst = max(worst, (y.float() - alone[:m].float()).abs().max().item())
        rows.append({"projection": name, "impl": impl, "K": k, "N": n, "same_rows": same, "worst_diff": worst,
                     "us_m1": round(time_ms(lambda f=fn: f(x[:1], w), cuda) * 1e3, 2),
                     "us_m3": round(time_ms(lambda f=fn: f(x[:3], w), cuda) * 1e3, 2)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script)")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/batch_invariance.jsonl")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("bench/batch_invariance.py needs a CUDA device (or --smoke with TRITON_INTERPRET=1)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    rows = [r for name, k, n in (SMOKE if args.smoke else SHAPES) for r in measure(name, k, n, device, dtype, cuda)]
    print_table(rows, ["projection", "impl", "K", "N", "same_rows", "worst_diff", "us_m1", "us_m3"])
    if not (args.smoke or args.no_save):
        print(append_jsonl("batch_invariance", rows, env_info()))


if __name__ == "__main__":
    main()
