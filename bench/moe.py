"""K3: routed experts (MoE) forward+backward: areno's Triton grouped GEMMs vs the per-expert loop and torch._grouped_mm.

    python bench/moe.py            # H200: 128 experts, top-8, hidden 2048, intermediate 768, bf16; 1k/8k/32k tokens
    python bench/moe.py --tokens --no-profile    # decode sizes only: bf16 vs FP8 experts (issue 41's 30B-A3B shape)
    TRITON_INTERPRET=1 python bench/moe.py --smoke     # CPU: tiny shapes, checks the script (times meaningless)

Workload: x [T, H] bf16, routing from softmax top-k of random logits (near-uniform expert loads), weights
w13 [E, 2I, H] and w2 [E, H, I]. Training sizes time forward+backward (autograd.grad of all four inputs: x, w13, w2,
topk_weights) and forward alone; decode sizes time the forward under no_grad, eager and (areno) CUDA-graph
replayed, on the bf16 experts and on their FP8 copies (FP8 rollout: ``quantize_weight_fp8`` stacks, ``fused_moe``'s
FP8 path; ``x_bf16`` = areno bf16 ms / areno fp8 ms, the decode step's expert weight bytes halved; 1 to 256 tokens:
R1's 256 streams decode 256 tokens a step).
FLOPs: forward 2*T*k*(H*2I + I*H), backward twice that; TFLOP/s against the H200's bf16 dense peak (790).
Baselines in the same process: the per-expert loop as transformers runs it (``fused_moe_native``) and, where the
installed torch has it, ``torch._grouped_mm`` over expert-sorted tokens (two grouped GEMMs, SiLU-and-mul between).
One JSON line per measurement goes to bench/results/moe.jsonl; the autotuner's chosen configs and a per-kernel
profile at the middle size are printed for tuning.
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

from areno.kernels.fp8 import quantize_weight_fp8  # noqa: E402
from areno.kernels.moe import gemm as moe_gemm  # noqa: E402
from areno.kernels.moe.fp8 import fused_moe_fp8_native  # noqa: E402
from areno.kernels.moe.fused import fused_moe, fused_moe_native, route_softmax_topk  # noqa: E402

PEAK_TFLOPS = 790.0  # H200 bf16 dense (BENCH.md)


def _grouped_mm_fn():
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


def grouped_mm_moe(x, w13, w2, topk_weights, topk_ids):
    """The torch._grouped_mm baseline: sort pairs by expert, two grouped GEMMs, weight, index_add back."""
    gmm = _grouped_mm_fn()
    k, E = topk_ids.shape[1], w13.shape[0]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    tok = order // k
    gate, up = gmm(x[tok], w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    o = gmm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    o = o * topk_weights.reshape(-1)[order, None].to(o.dtype)
    return torch.zeros_like(x).index_add(0, tok, o)


IMPLS = {"areno": fused_moe, "loop": fused_moe_native, "grouped_mm": grouped_mm_moe}


def make_problem(T, E, k, H, I, dtype, device):
    x = torch.randn(T, H, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(dtype)
    w, ids, _ = route_softmax_topk(torch.randn(T, E, device=device), k)
    return x, w13, w2, w, ids


def fwd_flops(T, k, H, I):
    return 2.0 * T * k * (H * 2 * I + I * H)


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _timing(fn, heavy, smoke):
    if smoke:
        return gpu_time_ms(fn, warmup=1, iters=1)
    return gpu_time_ms(fn, warmup=1, iters=3) if heavy else gpu_time_ms(fn, warmup=3, iters=10)


def bench_train(T, args, device, dtype, env):
    x, w13, w2, w, ids = make_problem(T, args.experts, args.top_k, args.hidden, args.intermediate, dtype, device)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, w)]
    dy = torch.randn_like(x)
    flops = fwd_flops(T, args.top_k, args.hidden, args.intermediate)
    rows, ref = [], {}
    for name, fn in IMPLS.items():
        if name == "loop" and T > args.loop_max_tokens:
            continue
        try:
            with torch.no_grad():
                ref[name] = fn(x, w13, w2, w, ids)

            def fwd_bwd(fn=fn):
                y = fn(*leaves, ids)
                torch.autograd.grad(y, leaves, dy)

            def fwd(fn=fn):
                with torch.no_grad():
                    fn(x, w13, w2, w, ids)

            heavy = name == "loop"
            for phase, f, fl in (("fwd+bwd", fwd_bwd, 3 * flops), ("fwd", fwd, flops)):
                ms = _timing(f, heavy, args.smoke)
                rows.append(dict(tokens=T, phase=phase, impl=name, ms=ms, tflops=fl / ms / 1e9,
                                 pct_peak=100 * fl / ms / 1e9 / PEAK_TFLOPS))
        except Exception as exc:  # a baseline the installed torch cannot run is reported, not fatal
            print(f"[moe bench] {name} at T={T} failed: {type(exc).__name__}: {str(exc)[:200]}")
        if device == "cuda":
            torch.cuda.empty_cache()
    base = ref.get("loop", ref.get("grouped_mm"))
    err = _rel_err(ref["areno"], base) if base is not None and "areno" in ref else None
    _ratios(rows, err)
    append_jsonl("moe", [dict(workload="K3", experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                              intermediate=args.intermediate, dtype=str(dtype), **r) for r in rows], env)
    return rows


def _ratios(rows, err=None):
    for r in rows:
        same = {o["impl"]: o["ms"] for o in rows if o["tokens"] == r["tokens"] and o["phase"] == r["phase"]}
        if r["impl"] == "areno":
            r["x_loop"] = same["loop"] / r["ms"] if "loop" in same else None
            r["x_grouped_mm"] = same["grouped_mm"] / r["ms"] if "grouped_mm" in same else None
            r["rel_err"] = err
        elif r["impl"].startswith("areno fp8"):  # the bf16 grouped GEMM's time over the FP8 one's (same capture)
            base = same.get(r["impl"].replace("areno fp8", "areno"))
            r["x_bf16"] = base / r["ms"] if base else None


def _graph_ms(fn):
    """CUDA time of ``fn`` captured once in a CUDA graph and replayed (after three warm-up calls on a side stream)."""
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return gpu_time_ms(graph.replay, warmup=3, iters=50)


def bench_decode(T, args, device, dtype, env):
    """Decode-size forwards: the bf16 paths, and areno on the FP8 expert stacks (``--rollout-dtype fp8``: 128 x 128
    block scales per expert, activations per token) against areno bf16 (``x_bf16``: bf16 ms over fp8 ms), with its
    error against the native FP8 reference (``rel_err``) and against the bf16 experts (``rel_err_bf16``)."""
    x, w13, w2, w, ids = make_problem(T, args.experts, args.top_k, args.hidden, args.intermediate, dtype, device)
    q13, q2 = quantize_weight_fp8(w13), quantize_weight_fp8(w2)
    flops = fwd_flops(T, args.top_k, args.hidden, args.intermediate)
    rows = []

    def add(impl, ms, **extra):
        rows.append(dict(tokens=T, phase="decode fwd", impl=impl, ms=ms, tflops=flops / ms / 1e9,
                         pct_peak=100 * flops / ms / 1e9 / PEAK_TFLOPS, **extra))

    for name, fn in IMPLS.items():
        try:
            with torch.no_grad():
                add(name, _timing(lambda fn=fn: fn(x, w13, w2, w, ids), name == "loop", args.smoke))
        except Exception as exc:
            print(f"[moe bench] {name} decode T={T} failed: {type(exc).__name__}: {str(exc)[:200]}")
    fp8 = lambda: fused_moe(x, q13, q2, w, ids)  # noqa: E731
    try:
        with torch.no_grad():
            y8, y16 = fp8(), fused_moe(x, w13, w2, w, ids)
            errs = dict(rel_err=_rel_err(y8, fused_moe_fp8_native(x, q13, q2, w, ids)), rel_err_bf16=_rel_err(y8, y16))
            add("areno fp8", _timing(fp8, False, args.smoke), **errs)
    except Exception as exc:
        print(f"[moe bench] areno fp8 decode T={T} failed: {type(exc).__name__}: {str(exc)[:200]}")
    if device == "cuda":
        bf16 = lambda: fused_moe(x, w13, w2, w, ids)  # noqa: E731
        for name, fn in (("areno (cuda graph)", bf16), ("areno fp8 (cuda graph)", fp8)):
            try:
                add(name, _graph_ms(fn))
            except Exception as exc:
                print(f"[moe bench] {name} capture at T={T} failed: {type(exc).__name__}: {str(exc)[:200]}")
    _ratios(rows)
    append_jsonl("moe", [dict(workload="K3-decode", experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                              intermediate=args.intermediate, dtype=str(dtype), **r) for r in rows], env)
    return rows


def profile_areno(T, args, device, dtype):
    """Per-kernel CUDA time of one areno forward+backward (where the time goes, for tuning)."""
    x, w13, w2, w, ids = make_problem(T, args.experts, args.top_k, args.hidden, args.intermediate, dtype, device)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, w)]
    dy = torch.randn_like(x)
    step = lambda: torch.autograd.grad(fused_moe(*leaves, ids), leaves, dy)
    step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    print(f"\nper-kernel profile, areno fwd+bwd at {T} tokens:")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=15, max_name_column_width=60))


def tuned_configs():
    out = {}
    for name in ("gate_up_tuned", "rows_tuned", "wgrad_tuned"):  # the down-grad GEMM runs on rows_tuned
        tuner = getattr(moe_gemm, name)
        out[name] = {str(k): str(v) for k, v in getattr(tuner, "cache", {}).items()}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[1024, 8192, 32768])
    p.add_argument("--decode-tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--loop-max-tokens", type=int, default=32768, help="skip the slow per-expert loop above this")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny CPU shapes under TRITON_INTERPRET=1")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.smoke:
        args.tokens, args.decode_tokens = [33], [1, 5]
        args.experts, args.top_k, args.hidden, args.intermediate = 8, 2, 64, 32
    env = env_info()
    print(f"K3 MoE: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{dtype}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, grouped_mm: "
          f"{'yes' if _grouped_mm_fn() is not None else 'no'}")
    torch.manual_seed(0)
    rows = []
    for T in args.tokens:
        rows += bench_train(T, args, device, dtype, env)
    for T in args.decode_tokens:
        rows += bench_decode(T, args, device, dtype, env)
    print()
    print_table(rows, ["tokens", "phase", "impl", "ms", "tflops", "pct_peak", "x_loop", "x_grouped_mm", "x_bf16",
                       "rel_err", "rel_err_bf16"])
    if device == "cuda":
        try:
            print("\nautotuned configs:", tuned_configs())
        except AttributeError as e:  # a renamed tuner: the numbers above are what matter
            print(f"\nautotuned configs unavailable: {e}")
        if not args.no_profile and args.tokens:
            mid = sorted(args.tokens)[len(args.tokens) // 2]
            try:
                profile_areno(mid, args, device, dtype)
            except Exception as exc:
                print(f"[moe bench] profile failed: {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
