"""The attention prologue of a decode step: the fused qkv_prologue kernel vs the five launches it replaces.

    python bench/qkv_prologue.py              # H200: Qwen3-0.6B heads (16 q, 8 kv, 128 dims), bf16, 28 layers

"unfused" is q_norm, k_norm, apply_rope(q), apply_rope(k), store_kvcache (areno's Triton kernels), "fused" one
qkv_prologue launch. Each is timed for one call per layer, as a CUDA graph (launch gaps count as in the engine's
captured decode step) and eagerly (Python and launch overheads too, as in prefill), and reported per layer.
Bytes the prologue must move per token: read (Hq + 2 Hkv) D, write q Hq D, k Hkv D and the cache 2 Hkv D, i.e.
(2 Hq + 5 Hkv) D elements, plus a cos/sin row. One JSON line per measurement goes to bench/results/qkv_prologue.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, gpu_time_ms, graph_replay, print_table  # noqa: E402

from areno.kernels.attention import prologue as qp  # noqa: E402
from areno.kernels.attention.paged import store_kvcache  # noqa: E402
from areno.kernels.norm import rms_norm  # noqa: E402
from areno.kernels.rope import apply_rope, rope_cos_sin  # noqa: E402

COPY_BW_GB_S = 4300.0  # H200 device-to-device copy, read + write (BENCH.md)


def unfused(qkv, pos, cos, sin, hq, hkv, d, wq, wk, eps, k_cache, v_cache, slots):
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = rms_norm(q.view(t, hq, d), wq, eps), rms_norm(k.view(t, hkv, d), wk, eps), v.view(t, hkv, d)
    q, k = apply_rope(q, pos, cos, sin), apply_rope(k, pos, cos, sin)
    store_kvcache(k, v, k_cache, v_cache, slots)
    return q, k, v


def eager(fn, layers):
    for _ in range(layers):
        fn()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256, 4096])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-save", action="store_true", help="do not append to bench/results/qkv_prologue.jsonl")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (the comparison is about launches and bandwidth on the GPU)")
    dtype, dev = getattr(torch, args.dtype), "cuda"
    hq, hkv, d, eps = args.heads, args.kv_heads, args.head_dim, 1e-6
    e = torch.tensor([], dtype=dtype).element_size()
    cos, sin = rope_cos_sin(d, 40960, 1e6, device=dev)
    wq, wk = (torch.randn(d, dtype=dtype, device=dev) for _ in range(2))
    env = env_info()
    print(f"# {env['gpu']}  torch {env['torch']}  triton {env['triton']}  git {env['git_sha']}  {args.dtype}")
    impls = {"fused": qp.qkv_prologue, "unfused": unfused}
    rows, records = [], []
    for t in args.tokens:
        qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=dev)
        pos = torch.randint(0, 40960, (t,), device=dev)
        blocks = (t + 15) // 16 + 1
        k_cache = torch.zeros(blocks, 16, hkv, d, dtype=dtype, device=dev)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(blocks * 16, device=dev)[:t]
        nbytes = t * ((2 * hq + 5 * hkv) * d * e + d * 4)
        times = {}
        with torch.inference_mode():
            for name, fn in impls.items():
                call = functools.partial(fn, qkv, pos, cos, sin, hq, hkv, d, wq, wk, eps, k_cache, v_cache, slots)
                layers = functools.partial(eager, call, args.layers)
                times[name, "graph"] = gpu_time_ms(graph_replay(layers), iters=args.iters) / args.layers
                times[name, "eager"] = gpu_time_ms(layers, iters=args.iters) / args.layers
        for (name, mode), ms in times.items():
            gb_s = nbytes / (ms * 1e-3) / 1e9
            rec = {
                "op": "qkv_prologue", "impl": name, "mode": mode, "tokens": t, "shape": f"{hq}+2x{hkv}x{d}",
                "dtype": args.dtype, "ms_per_layer": ms, "gb_s": gb_s, "frac_copy_bw": gb_s / COPY_BW_GB_S,
                "speedup_vs_unfused": times["unfused", mode] / ms, "min_bytes": nbytes,
            }  # fmt: skip
            records.append(rec)
            rows.append({**rec, "us_per_layer": ms * 1e3})
    print_table(rows, ["tokens", "mode", "impl", "us_per_layer", "gb_s", "frac_copy_bw", "speedup_vs_unfused"])
    if not args.no_save:
        path = append_jsonl("qkv_prologue", records, env)
        print(f"# appended {len(records)} lines to {path}")


if __name__ == "__main__":
    main()
