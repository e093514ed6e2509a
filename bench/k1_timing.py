"""K1 (8 x 4096, 16/8 heads, d128, causal, bf16) fwd+bwd timed four ways, areno beside SDPA cuDNN and flash:

- eager: ``triton.testing.do_bench`` (an L2 flush before each call; what ``bench/attention.py`` reports);
- graph: ``triton.testing.do_bench_cudagraph`` (the same call captured once and replayed: GPU time, no host work);
- loop: 20 calls back to back between two CUDA events, no flush;
- kernels: the torch profiler's sum of CUDA kernel time per call, and the host time to enqueue one call;
- paired rounds (``--rounds``): each impl timed once per round (10 calls back to back, eagerly and as graph replays)
  in a rotated order, the ratio to cuDNN taken per round: the H200 moves its clocks under this load, so timings
  taken one impl after the other are not comparable; these are (median and range printed).

    python bench/k1_timing.py [--seq 4096] [--batch 8] [--rounds 15] [--trace]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, graph_replay, print_table  # noqa: E402

from areno.kernels.attention import attention  # noqa: E402


def impls(batch, seq, hq, hkv, d):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(batch * seq, hq, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(batch * seq, hkv, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(batch * seq, hkv, d, device=dev, dtype=dt, requires_grad=True)
    cu = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * seq
    out = [("areno", lambda q, k, v: attention(q, k, v, cu, cu, seq, seq, causal=True), (q, k, v))]
    qb, kb, vb = (t.detach().view(batch, seq, -1, d).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
        def run(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.append((name, run, (qb, kb, vb)))
    return out


def profiled(run, n):
    """The torch profiler's record (CUDA activity) of ``n`` calls of ``run`` after a warm one."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    return prof


def kernel_ms(step, reps=10):
    prof = profiled(step, reps)
    per = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if us > 0 and evt.key and not evt.key.startswith(("cuda", "Memcpy", "Memset")):
            per[evt.key] = us / 1e3 / reps
    return per


def timeline(step, graph=False, n=3):
    """Print each CUDA kernel of ``n`` consecutive calls (eager, or replays of one captured call): start relative to
    the first, duration, and the idle gap since the previous kernel ended (us)."""
    prof = profiled(graph_replay(step) if graph else step, n)
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    t0, prev = evs[0].time_range.start, None
    for e in evs:
        a, b = e.time_range.start, e.time_range.end
        gap = "" if prev is None else f"{a - prev:8.1f}"
        print(f"  {'graph' if graph else 'eager'} {a - t0:9.1f} {b - a:8.1f} {gap:>8} {e.name[:70]}")
        prev = b


def loop_ms(step, n=20):
    step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        step()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def paired_rounds(steps, rounds, n=10):
    """{impl: [ms per call of each round]} for eager calls and graph replays: every round times each impl (n calls
    back to back between two events) in a rotated order, so that all of them meet the GPU's clock and power states
    alike (an H200 under this load moves its clocks by ~10% between seconds)."""
    names = list(steps)
    replays = {name: graph_replay(step) for name, step in steps.items()}
    out = {("eager", name): [] for name in names} | {("graph", name): [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            out[("eager", name)].append(loop_ms(steps[name], n))
            out[("graph", name)].append(loop_ms(replays[name], n))
    return out


def host_ms(step, n=5):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        out.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return sorted(out)[n // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--trace", action="store_true", help="print the kernel timeline of three calls, eager and graphed")
    ap.add_argument("--rounds", type=int, default=15, help="paired rounds (each impl timed once per round)")
    args = ap.parse_args()
    rows, steps = [], {}
    for name, fn, inputs in impls(args.batch, args.seq, 16, 8, 128):
        g = torch.randn_like(fn(*inputs))

        def step(fn=fn, inputs=inputs, g=g):
            return torch.autograd.grad(fn(*inputs), inputs, g)

        eager = triton.testing.do_bench(step, warmup=10, rep=60, return_mode="median")
        try:
            graph = triton.testing.do_bench_cudagraph(step, rep=60, return_mode="median")
        except Exception as e:
            print(f"{name}: graph timing failed: {type(e).__name__}: {str(e)[:160]}")
            graph = None
        steps[name] = step
        kern = kernel_ms(step)
        rows.append({"impl": name, "eager_ms": eager, "graph_ms": graph, "loop_ms": loop_ms(step),
                     "kernel_ms": sum(kern.values()), "host_ms": host_ms(step)})
        if args.trace:
            timeline(step)
            timeline(step, graph=True)
        top = sorted(kern.items(), key=lambda x: -x[1])
        print(f"{name} kernels: " + ", ".join(f"{k[:60]} {v:.3f}" for k, v in top))
    paired = paired_rounds(steps, args.rounds)
    for r in rows:
        for mode in ("eager", "graph"):
            t = paired[(mode, r["impl"])]
            r[f"paired_{mode}_ms"] = statistics.median(t)
            if "sdpa cudnn" in steps:
                ratios = sorted(c / a for a, c in zip(t, paired[(mode, "sdpa cudnn")]))
                r[f"paired_{mode}_x_cudnn"] = statistics.median(ratios)
                r[f"paired_{mode}_x_cudnn_range"] = f"{ratios[0]:.3f}-{ratios[-1]:.3f}"
    ref = {r["impl"]: r for r in rows}.get("sdpa cudnn")
    for r in rows:
        for col in ("eager", "graph", "loop", "kernel"):
            if ref and r[f"{col}_ms"] and ref[f"{col}_ms"]:
                r[f"{col}_x_cudnn"] = ref[f"{col}_ms"] / r[f"{col}_ms"]
    cols = ["impl", "eager_ms", "graph_ms", "loop_ms", "kernel_ms", "host_ms", "eager_x_cudnn", "graph_x_cudnn",
            "loop_x_cudnn", "kernel_x_cudnn"]
    print_table(rows, cols)
    cols = ["impl", "paired_eager_ms", "paired_eager_x_cudnn", "paired_eager_x_cudnn_range", "paired_graph_ms",
            "paired_graph_x_cudnn", "paired_graph_x_cudnn_range"]
    print_table(rows, cols)
    if not args.no_save:
        path = append_jsonl("k1_timing", [{"workload": "K1", "batch": args.batch, "seq": args.seq, **r} for r in rows])
        print(f"results: {path}")


if __name__ == "__main__":
    main()
