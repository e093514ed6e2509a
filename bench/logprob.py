"""K2: per-token log-prob of a linear LM head, forward + backward, bf16: areno vs torch vs Liger-Kernel.

    python bench/logprob.py                       # 16,384 tokens, hidden 1024, vocab 151,936 (BENCH.md K2)
    python bench/logprob.py --hidden 1024 4096    # more shapes

FLOPs: forward 2 N V H; areno's backward recomputes the logits and runs the two gradient GEMMs, so fwd+bwd is
8 N V H (20.4 TFLOP at K2, 26 ms at 790 TFLOP/s); torch's path keeps the logits and does 6 N V H, and so does
``areno_loss`` (``linear_logprobs_loss``: the same -mean loss with its gradient taken in the forward). The table gives
time, peak memory above the inputs (the torch path holds [N, V] logits in bf16 and fp32), TFLOP/s counted as 8 N V H
for every row (same work unit), and the fraction of the 26 ms GEMM floor. Liger is optional: its pure-Python
wheel on PYTHONPATH; skipped with a note when missing.

A/B of areno's variants (passed to linear_logprobs as private keywords, see areno/kernels/logprobs/core.py
`options`), one row each, in the same run as the torch baseline:

    python bench/logprob.py --impls torch areno --variants loads=pointer loads=tma loads=tma,chunk=134217728
    python bench/logprob.py --impls torch areno --profile     # per-kernel GPU time of one areno fwd+bwd

Variant keys: loads (auto|tma|pointer -> ``_loads``), chunk (elements of a backward chunk -> ``_bwd_chunk``),
entropy (0|1: the loss also takes the entropy term). The autotuner's picks are printed at the end (the first run of
each row compiles and autotunes outside the timing).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402

PEAK_TFLOPS = 790.0  # H200 bf16 dense, BENCH.md


VARIANT_KEYS = {"loads": ("_loads", str), "chunk": ("_bwd_chunk", int)}  # spec key -> (keyword, type)


def parse_variant(spec):
    """'loads=tma,chunk=134217728' -> ({keyword: value}, entropy flag); raises ValueError naming a bad key or
    value."""
    kwargs, entropy = {}, False
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == "entropy" and value in ("0", "1"):
            entropy = value == "1"
        elif key in VARIANT_KEYS and value:
            name, kind = VARIANT_KEYS[key]
            try:
                kwargs[name] = kind(value)
            except ValueError:
                raise ValueError(f"variant {spec!r}: {item!r} needs a {kind.__name__} value") from None
        else:
            raise ValueError(f"variant {spec!r}: {item!r} is not one of {sorted(VARIANT_KEYS) + ['entropy']}=VALUE")
    return kwargs, entropy


def _impls(with_liger, variants=()):
    from areno.kernels.logprobs import linear_logprobs

    def torch_path(h, w, t):
        lp = (h @ w.T).float().log_softmax(-1).gather(1, t[:, None])[:, 0]
        (-lp.mean()).backward()

    def areno(h, w, t, **variant):
        (-linear_logprobs(h, w, t, **variant).mean()).backward()

    def areno_loss(h, w, t):  # the same -mean loss, its gradient taken in the forward (linear_logprobs_loss)
        from areno.kernels.logprobs import linear_logprobs_loss

        weights = torch.full(t.shape, -1.0 / t.numel(), device=t.device)
        linear_logprobs_loss(h, w, t, weights)[0].backward()

    def areno_entropy(h, w, t, **variant):
        lp, ent = linear_logprobs(h, w, t, return_entropy=True, **variant)
        (-lp.mean() - 0.01 * ent.mean()).backward()

    def torch_fwd(h, w, t):
        with torch.no_grad():
            (h @ w.T).float().log_softmax(-1).gather(1, t[:, None])

    def areno_fwd(h, w, t):
        with torch.no_grad():
            linear_logprobs(h, w, t)

    impls = {"torch": torch_path, "areno": areno, "areno_loss": areno_loss, "areno+entropy": areno_entropy}
    for spec in variants:
        kwargs, entropy = parse_variant(spec)

        def variant(h, w, t, kwargs=kwargs, fn=areno_entropy if entropy else areno):
            fn(h, w, t, **kwargs)

        impls[f"areno[{spec}]"] = variant
    if with_liger:
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            flce = LigerFusedLinearCrossEntropyLoss()
            impls["liger_flce"] = lambda h, w, t: flce(w, h, t).backward()
        except ImportError as e:
            print(f"note: Liger-Kernel not installed ({e}); its row is skipped", flush=True)
    impls["torch fwd-only"] = torch_fwd
    impls["areno fwd-only"] = areno_fwd
    return impls


def _check(h, w, t):
    """areno vs the torch path on a slice: max |logprob diff| (bf16 logits in torch, fp32 accumulation in areno)."""
    from areno.kernels.logprobs import linear_logprobs

    with torch.no_grad():
        n = min(2048, h.shape[0])
        ref = (h[:n].float() @ w.float().T).log_softmax(-1).gather(1, t[:n, None])[:, 0]
        return (linear_logprobs(h[:n], w, t[:n]) - ref).abs().max().item()


def _peak_gib(run, cuda):
    """Peak memory above what is allocated before ``run()`` (0 on CPU, where it is not tracked)."""
    if not cuda:
        run()
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _kernel_class(name):
    if "_stats_kernel" in name:
        return "forward stats kernel (Triton)"
    if "_grad_logits_kernel" in name:
        return "logit-gradient recompute (Triton)"
    if any(k in name.lower() for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "gradient GEMMs (cuBLAS)"
    return "other"


def profile(fn, h, w, t):
    """GPU time per kernel class of one ``fn`` call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def run():
        fn(h, w, t)
        h.grad = None
        w.grad = None

    run()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    per_class, per_kernel = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per_class[_kernel_class(e.name)] += us / 1e3
            per_kernel[e.name][0] += us / 1e3
            per_kernel[e.name][1] += 1
    for cls, ms in sorted(per_class.items(), key=lambda kv: -kv[1]):
        print(f"  {cls:40s} {ms:8.2f} ms")
    for name, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"    {ms:8.2f} ms  x{n:<4d} {name[:110]}")


def autotune_picks():
    """The autotuner's chosen config per key of the two Triton kernels (after the runs)."""
    from areno.kernels.logprobs import core as mod

    for name in ("stats_autotuner", "grad_autotuner"):
        for key, cfg in getattr(mod, name).cache.items():
            print(f"  {name} {key}: {cfg}")


def bench(N, H, V, iters, with_liger, device="cuda", variants=(), impls=None, do_profile=False):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h = torch.randn(N, H, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, H, device=device, dtype=dtype) * 0.02).requires_grad_()
    t = torch.randint(0, V, (N,), device=device)
    flops = 8.0 * N * V * H
    floor_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3
    rows = []
    every = _impls(with_liger, variants)
    if impls:  # the named base rows (and their fwd-only rows) plus every variant
        every = {k: f for k, f in every.items() if k.replace(" fwd-only", "") in impls or k.startswith("areno[")}
    for name, fn in every.items():
        def run(fn=fn):
            fn(h, w, t)
            h.grad = None
            w.grad = None

        try:
            run()  # compile / autotune outside the timing
            peak = _peak_gib(run, device == "cuda")
            ms = gpu_time_ms(run, warmup=3, iters=iters)
        except Exception as e:  # one failing row must not lose the others
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
            rows.append({"impl": name, "N": N, "H": H, "V": V, "error": f"{type(e).__name__}: {e}"})
            continue
        work = flops / 4 if "fwd-only" in name else flops
        rows.append({"impl": name, "N": N, "H": H, "V": V, "ms": ms, "peak_extra_GiB": round(peak, 3),
                     "TFLOPs": work / ms / 1e9, "floor_frac": (work / flops * floor_ms) / ms})  # fmt: skip
    ref = {r["impl"]: r for r in rows if "ms" in r}
    for r in rows:
        if "ms" in r and "torch" in ref:
            base = ref["torch fwd-only" if "fwd-only" in r["impl"] else "torch"]
            r["speedup_vs_torch"] = base["ms"] / r["ms"]
            r["mem_frac_of_torch"] = r["peak_extra_GiB"] / max(base["peak_extra_GiB"], 1e-9)
    if do_profile and device == "cuda":
        for name, fn in every.items():
            if name.startswith("areno") and "fwd-only" not in name:
                print(f"{name}: GPU time per kernel class (one fwd+bwd)", flush=True)
                profile(fn, h, w, t)
    try:
        diff = _check(h.detach(), w.detach(), t)
        print(f"N={N} H={H} V={V}: max |areno - fp32 torch| logprob = {diff:.2e}", flush=True)
    except Exception as e:
        print(f"check failed: {e}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script at tiny shapes (fp32)")
    ap.add_argument("--impls", nargs="+", default=None,
                    help="base rows to run (torch, areno, areno_loss, areno+entropy, liger_flce; each with its "
                         "fwd-only row "
                         "where it has one); default: all")  # fmt: skip
    ap.add_argument("--variants", nargs="+", default=[], metavar="SPEC",
                    help="extra areno rows, each 'key=value,...' with keys loads, chunk, entropy")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of one fwd+bwd of each areno row")
    args = ap.parse_args()
    known = {"torch", "areno", "areno_loss", "areno+entropy", "liger_flce"}
    if args.impls and not set(args.impls) <= known:
        ap.error(f"--impls: unknown {sorted(set(args.impls) - known)} (choose from {sorted(known)})")
    if args.impls and "liger_flce" not in args.impls:
        args.no_liger = True
    for spec in args.variants:
        try:
            parse_variant(spec)
        except ValueError as e:
            ap.error(f"--variants: {e}")
    if args.profile and args.device != "cuda":
        ap.error("--profile needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/logprob.py needs a CUDA GPU (or --device cpu for a smoke run)")
    env = env_info()
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  sha {env['git_sha']}", flush=True)
    rows = []
    for H in args.hidden:
        rows += bench(args.tokens, H, args.vocab, args.iters, not args.no_liger, args.device, args.variants,
                      args.impls, args.profile)  # fmt: skip
    cols = ["impl", "N", "H", "V", "ms", "peak_extra_GiB", "TFLOPs", "floor_frac", "speedup_vs_torch",
            "mem_frac_of_torch"]  # fmt: skip
    print_table(rows, cols)
    if args.device == "cuda":
        print("autotune picks:")
        autotune_picks()
    print(f"results appended to {append_jsonl('logprob', [{'workload': 'K2', **r} for r in rows], env)}")


if __name__ == "__main__":
    main()
