"""Small fused ops (rms_norm, apply_rope, silu_and_mul): areno's Triton kernels vs the native PyTorch path.

    python bench/small_ops.py                 # H200: 16k tokens, hidden 1024, I 3072, 16 heads x 128, bf16

Each op is timed forward and backward (autograd.grad on a retained graph) with CUDA events, L2 flushed between
iterations. GB/s counts the bytes the op must move at least (below, per op) and is reported as a fraction of the
H200's measured copy bandwidth (4.3 TB/s). One JSON line per measurement goes to bench/results/small_ops.jsonl.
On CPU, run with TRITON_INTERPRET=1 and a tiny --tokens to check the script itself (times meaningless there).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


from common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402

from areno.kernels import activation, rope  # noqa: E402
from areno.kernels import norm as rms_norm  # noqa: E402

COPY_BW_GB_S = 4300.0  # H200 device-to-device copy, read + write (BENCH.md)


def _cases(tokens: int, hidden: int, inter: int, heads: int, head_dim: int, dtype, device):
    """(name, shape, {impl: fn}, make_inputs, fwd_bytes, bwd_bytes) per op; inputs are made fresh per case."""
    e = torch.tensor([], dtype=dtype).element_size()
    m, n = tokens, hidden

    def norm_inputs():
        return [torch.randn(m, n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device)]

    def norm_res_inputs():
        return norm_inputs() + [torch.randn(m, n, dtype=dtype, device=device)]

    def qk_inputs():  # Qwen3 k norm: a strided [T, Hkv, D] slice of the fused qkv projection
        qkv = torch.randn(m, (heads + 2 * (heads // 2)) * head_dim, dtype=dtype, device=device)
        k = qkv[:, heads * head_dim : (heads + heads // 2) * head_dim].view(m, heads // 2, head_dim)
        return [k, torch.randn(head_dim, dtype=dtype, device=device)]

    cos, sin = rope.rope_cos_sin(head_dim, 40960, 1e6, device=device)

    def rope_inputs():
        pos = torch.randint(0, 40960, (m,), device=device, dtype=torch.int32)
        return [torch.randn(m, heads, head_dim, dtype=dtype, device=device), pos, cos, sin]

    def silu_inputs():
        return [torch.randn(m, 2 * inter, dtype=dtype, device=device)]

    eps = 1e-6
    kv_elems = m * (heads // 2) * head_dim
    rope_elems = m * heads * head_dim
    rope_table = m * head_dim * 4  # one fp32 cos + sin row (head_dim / 2 each) per token
    return [
        # fwd: read x, write y;  bwd: read x, dy, write dx (weight and rstd are negligible)
        (
            "rms_norm",
            f"{m}x{n}",
            {
                "triton": lambda x, w: rms_norm.RMSNormFunction.apply(x, w, None, eps),
                "native": lambda x, w: rms_norm.rms_norm_native(x, w, eps),
            },
            norm_inputs,
            2 * m * n * e,
            3 * m * n * e,
        ),
        # fwd: read x, residual, write h, y;  bwd: read h, dy, dh, write dx (shared by x and residual)
        (
            "rms_norm+residual",
            f"{m}x{n}",
            {
                "triton": lambda x, w, r: rms_norm.RMSNormFunction.apply(x, w, r, eps),
                "native": lambda x, w, r: rms_norm.rms_norm_native(x, w, eps, residual=r),
            },
            norm_res_inputs,
            4 * m * n * e,
            4 * m * n * e,
        ),
        (
            "qk_norm (strided k)",
            f"{m}x{heads // 2}x{head_dim}",
            {
                "triton": lambda k, w: rms_norm.RMSNormFunction.apply(k, w, None, eps),
                "native": lambda k, w: rms_norm.rms_norm_native(k, w, eps),
            },
            qk_inputs,
            2 * kv_elems * e,
            3 * kv_elems * e,
        ),
        # fwd and bwd: read x (dy), write y (dx), read a cos/sin row per token
        (
            "apply_rope",
            f"{m}x{heads}x{head_dim}",
            {"triton": rope.RopeFunction.apply, "native": rope.apply_rope_native},
            rope_inputs,
            2 * rope_elems * e + rope_table,
            2 * rope_elems * e + rope_table,
        ),
        # fwd: read 2I, write I;  bwd: read 2I and dy (I), write 2I
        (
            "silu_and_mul",
            f"{m}x{2 * inter}",
            {"triton": activation.SiluAndMulFunction.apply, "native": activation.silu_and_mul_native},
            silu_inputs,
            3 * m * inter * e,
            5 * m * inter * e,
        ),
    ]


def _measure(fn, inputs, warmup, iters):
    with torch.no_grad():
        fwd_ms = gpu_time_ms(lambda: fn(*inputs), warmup=warmup, iters=iters)
    # Gradients flow to activations and weights, never to positions or the cos/sin tables (the last two of rope).
    n_diff = 1 if len(inputs) == 4 else len(inputs)
    grad_inputs = [t.detach().requires_grad_() if i < n_diff else t for i, t in enumerate(inputs)]
    diff = [t for t in grad_inputs if t.requires_grad]
    outs = fn(*grad_inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    upstream = [torch.randn_like(o) for o in outs]
    bwd_ms = gpu_time_ms(
        lambda: torch.autograd.grad(outs, diff, upstream, retain_graph=True), warmup=warmup, iters=iters
    )
    return fwd_ms, bwd_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-save", action="store_true", help="do not append to bench/results/small_ops.jsonl")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no CUDA device: run with TRITON_INTERPRET=1 and a tiny --tokens to check the script on CPU")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    env = env_info()
    print(f"# {env['gpu']}  torch {env['torch']}  triton {env['triton']}  git {env['git_sha']}  {args.dtype}")

    rows, records = [], []
    cases = _cases(args.tokens, args.hidden, args.intermediate, args.heads, args.head_dim, dtype, device)
    for name, shape, impls, make_inputs, fwd_bytes, bwd_bytes in cases:
        inputs = make_inputs()
        times = {impl: _measure(fn, inputs, args.warmup, args.iters) for impl, fn in impls.items()}
        for impl, (fwd_ms, bwd_ms) in times.items():
            for pass_, ms, nbytes, base_ms in (
                ("fwd", fwd_ms, fwd_bytes, times["native"][0]),
                ("bwd", bwd_ms, bwd_bytes, times["native"][1]),
            ):
                gb_s = nbytes / (ms * 1e-3) / 1e9
                rec = {
                    "op": name,
                    "impl": impl,
                    "pass": pass_,
                    "shape": shape,
                    "dtype": args.dtype,
                    "ms": ms,
                    "gb_s": gb_s,
                    "frac_copy_bw": gb_s / COPY_BW_GB_S,
                    "speedup_vs_native": base_ms / ms,
                    "min_bytes": nbytes,
                }
                records.append(rec)
                rows.append({**rec, "us": ms * 1e3})
        del inputs
    print_table(rows, ["op", "shape", "pass", "impl", "us", "gb_s", "frac_copy_bw", "speedup_vs_native"])
    if not args.no_save:
        path = append_jsonl("small_ops", records, env)
        print(f"# appended {len(records)} lines to {path}")


if __name__ == "__main__":
    main()
