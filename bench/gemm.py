"""Small-M GEMM (decode projections): areno's split-K Triton GEMM vs cuBLAS ``F.linear``, with a config sweep.

    python bench/gemm.py                               # H200: sweep, summary table, suggested picker table (~2 min)
    python bench/gemm.py --no-sweep                    # cuBLAS vs the current picker (default_config) only
    TRITON_INTERPRET=1 python bench/gemm.py --smoke    # CPU: tiny shapes, checks the script (times meaningless)

Shapes: Qwen3-0.6B's per-layer projections in decode, y = x @ W^T with x [M, K] and W [N, K], bf16, M = the batch
(one token per sequence): qkv_proj (K 1024, N 4096), o_proj (2048, 1024), gate_up_proj (1024, 6144), down_proj
(3072, 1024), plus the LM head (1024, 151936) for information (not in the picker table). M in 64, 128, 256, 512.

Timing: a CUDA graph of n calls (as decode replays one), each call with its own copy of W so that the weights
come from HBM, not L2 (the copies total >= 256 MB; in a real decode step ~30 MB of other weights pass between two
calls of one layer's GEMM); x stays the same (it is hot in L2 in decode too). Time per call = replay time / n,
median of several replays. Bytes = 2 (N K + M K + M N) (weight, input, output); FLOPs = 2 M N K. The floor is
max(bytes / copy bandwidth, FLOPs / 790 TFLOP/s) with the device-to-device copy bandwidth (read + write bytes / time)
measured in the same run; read_us, the time of a kernel that only reads W in the same setting, is the practical
floor at these sizes (launch, ramp-up and tail included). Every config's output is checked against cuBLAS (max abs
error) before it is timed.
One JSON line per measurement (cuBLAS, the picker's config, the best and the top sweep configs per shape):
bench/results/gemm.jsonl. The last printout is a ``TUNED`` table for areno/kernels/gemm.py and a TRITON_MAX_M.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, print_table  # noqa: E402

from areno.kernels.gemm import GemmConfig, default_config, gemm_launch  # noqa: E402

CUDA = torch.cuda.is_available()
PEAK_TFLOPS = 790.0  # H200 bf16 dense, measured on random data (KINDS.md / BENCH.md)
ROTATE_BYTES = 256 << 20  # weight copies per timed graph: well past the 60 MB L2
DECODE_SHAPES = [("qkv_proj", 1024, 4096), ("o_proj", 2048, 1024), ("gate_up_proj", 1024, 6144),
                 ("down_proj", 3072, 1024)]  # fmt: skip
LM_HEAD = ("lm_head", 1024, 151936)
TOP_RECORDED = 8  # sweep configs per (shape, M) written to the JSON lines besides the best
MARGIN = 0.98  # the suggested table keeps a Triton config where it took < 98% of cuBLAS's time


@triton.jit
def _read_kernel(w_ptr, out_ptr, numel, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # The weight-read floor: each program sums BLOCK * ITERS elements (loads issued together) and writes one float.
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_us(weights, calls) -> float:
    """Time to only read one weight in the same setting as the GEMMs (best of a few read-kernel shapes)."""
    numel = weights[0].numel()
    out = torch.empty(triton.cdiv(numel, 1024), device=weights[0].device)
    best = float("inf")
    for block, iters, warps in ((1024, 1, 4), (2048, 4, 4), (4096, 4, 8)) if CUDA else ((1024, 1, 4),):
        grid = (triton.cdiv(numel, block * iters),)
        call = lambda w, b=block, i=iters, nw=warps, g=grid: _read_kernel[g](w, out, numel, BLOCK=b, ITERS=i,
                                                                              num_warps=nw)  # fmt: skip
        best = min(best, time_us(call, weights, calls))
    return best


def copy_bandwidth_gbs() -> float | None:
    if not CUDA:
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=60, return_mode="median")
    return 2 * x.numel() / t / 1e6


def time_us(call, weights, calls: int, replays: int = 7) -> float:
    """Per-call time of ``call(w)`` over ``calls`` calls cycling through ``weights`` (one CUDA graph on a GPU)."""
    if not CUDA:  # the interpreter: a sanity number only
        t0 = time.perf_counter()
        for i in range(2):
            call(weights[i % len(weights)])
        return (time.perf_counter() - t0) / 2 * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(weights[0])  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) / calls * 1e3


def sweep_configs(M: int, N: int, K: int, num_sms: int, smoke: bool, full: bool):
    """The configs tried at one shape, pruned so the whole sweep stays near two minutes on an H200."""
    if smoke:
        return [GemmConfig(16, bn, bk, sk, 4, 2) for bn, bk, sk in itertools.product((16, 32), (16, 32), (1, 2, 3))]
    out = []
    for bm, bn, bk, sk, warps, stages in itertools.product((16, 32, 64, 128, 256), (32, 64, 128), (64, 128, 256),
                                                           (1, 2, 4, 8), (4, 8), (3, 4, 6, 8)):  # fmt: skip
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        k_tiles = K // (bk * sk)  # per split
        if bm > max(16, triton.next_power_of_2(M)) or triton.cdiv(M, bm) > 8:
            continue  # a tile past M, or the weight read from L2 more than 8 times
        if not full and bm < min(64, triton.next_power_of_2(M)):
            continue  # thin row tiles lost at every M >= 64 in the first sweeps
        if k_tiles < 2:
            continue  # fewer than two K tiles per split
        if stages > max(3, k_tiles + 1):
            continue  # deeper than the loop: the same as fewer stages
        if sk > 1 and (tiles >= 2 * num_sms or tiles * sk > 8 * num_sms):
            continue  # splitting K only to fill the SMs
        if (bm + bn) * bk * 2 * stages > 200 * 1024:
            continue  # shared memory of the pipeline
        if warps == 8 and (bm * bn < 8192 or not full and bm < 64) or warps == 4 and bm * bn > 16384:
            continue  # (8 warps for small tiles idle; 4 warps for a big fp32 accumulator spill)
        if not full and (bk == 256 and stages > 4 or bk == 64 and bm < 128):
            continue  # (BLOCK_K 64 won only with 128-row tiles in the first sweeps)
        out.append(GemmConfig(bm, bn, bk, sk, warps, stages))
    return out


def bench_shape(name, K, N, M, dtype, num_sms, copy_gbs, smoke, sweep, full):
    dev = "cuda" if CUDA else "cpu"
    flops = 2 * M * N * K
    nbytes = (N * K + M * K + M * N) * torch.finfo(dtype).bits // 8
    floor_us = max(nbytes / (copy_gbs * 1e3), flops / (PEAK_TFLOPS * 1e6)) if copy_gbs else None
    copies = 2 if smoke else max(2, triton.cdiv(ROTATE_BYTES, N * K * 2))
    calls = max(20, copies) if CUDA else 2
    x = torch.randn(M, K, device=dev, dtype=dtype)
    weights = [(torch.randn(N, K, device=dev) * K**-0.5).to(dtype) for _ in range(copies)]
    ref = F.linear(x.float(), weights[0].float()) if not CUDA else F.linear(x, weights[0]).float()
    tol = 2.0**-6 * ref.abs().max().item()  # bf16 rounding of |y| plus a different summation order
    info = {"shape": name, "M": M, "K": K, "N": N, "dtype": str(dtype).replace("torch.", ""), "copies": copies}

    def row(impl, us, cfg=None, err=None):
        r = {"workload": "gemm", "impl": impl, **info, "us": us, "GB/s": nbytes / us / 1e3, "TFLOP/s": flops / us / 1e6,
             "frac_floor": floor_us / us if floor_us else None, "max_abs_err": err}  # fmt: skip
        if cfg is not None:
            r.update(config=list(cfg), ctas=triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n) * cfg.split_k)
        return r

    rows = [row("read_floor", read_us(weights, calls))]
    if CUDA:
        rows.append(row("cublas", time_us(lambda w: F.linear(x, w), weights, calls)))
    picked = default_config(M, N, K, num_sms)
    configs = [] if picked is None else [("picker", picked)]
    if picked is None and CUDA:  # the table says cuBLAS here: linear() would call F.linear
        rows.append({**rows[-1], "impl": "picker", "config": None})
    if sweep:
        configs += [("sweep", c) for c in sweep_configs(M, N, K, num_sms, smoke, full)]
    tried = []
    for impl, cfg in configs:
        try:
            err = (gemm_launch(x, weights[0], cfg).float() - ref).abs().max().item()
        except Exception as e:  # e.g. out of shared memory at this tile shape
            print(f"  {name} M={M} {tuple(cfg)}: failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        if not err <= tol:
            print(f"  {name} M={M} {tuple(cfg)}: WRONG, max abs err {err:.3g} > {tol:.3g}")
            rows.append(row(impl + " (wrong)", float("nan"), cfg, err))
            continue
        r = row(impl, time_us(lambda w, cfg=cfg: gemm_launch(x, w, cfg), weights, calls), cfg, err)
        (rows.append(r) if impl == "picker" else tried.append(r))
    tried.sort(key=lambda r: r["us"])
    if tried:
        rows.append({**tried[0], "impl": "best"})
        rows += tried[1 : 1 + TOP_RECORDED]
    del weights
    return rows


def cfg_str(cfg) -> str:
    if cfg is None:
        return "cublas"
    bm, bn, bk, sk, warps, stages = cfg
    return f"{bm}x{bn}x{bk} sk{sk} w{warps} s{stages}"


def cfg_code(r) -> str:
    if r is None:
        return "None"
    return f"GemmConfig({', '.join(map(str, r['config']))})"


def summary(rows):
    """One line per (shape, M): cuBLAS, the picker and the best sweep config side by side."""
    out = []
    keys = list(dict.fromkeys((r["shape"], r["M"]) for r in rows))
    for shape, M in keys:
        at = {r["impl"]: r for r in rows if (r["shape"], r["M"]) == (shape, M)}
        cub, pick, best = at.get("cublas"), at.get("picker"), at.get("best")
        s = {"shape": shape, "M": M, "K": (cub or pick or best)["K"], "N": (cub or pick or best)["N"]}
        if cub:
            s.update(cublas_us=cub["us"], cublas_GBps=cub["GB/s"])
        if "read_floor" in at:
            s["read_us"] = at["read_floor"]["us"]
        if pick:
            s.update(picker_us=pick["us"], picker_cfg=cfg_str(pick["config"]))
        if best:
            s.update(best_us=best["us"], best_cfg=cfg_str(best["config"]), ctas=best["ctas"],
                     GBps=best["GB/s"], TFLOPs=best["TFLOP/s"], frac_floor=best["frac_floor"])  # fmt: skip
            if cub:
                s["speedup"] = cub["us"] / best["us"]
        out.append(s)
    return out


def suggest(rows, shapes):
    """A TUNED table (best config per (N, K) and M, None where it did not beat cuBLAS by MARGIN) and TRITON_MAX_M."""
    names = {name for name, _, _ in shapes}
    best = {(r["shape"], r["M"]): r for r in rows if r["impl"] == "best" and r["shape"] in names}
    cub = {(r["shape"], r["M"]): r["us"] for r in rows if r["impl"] == "cublas"}
    chosen = {k: (r if k not in cub or r["us"] < MARGIN * cub[k] else None) for k, r in best.items()}
    print(f"\nsuggested picker table for areno/kernels/gemm.py (None: the best config was not {1 - MARGIN:.0%} under "
          f"cuBLAS):\nTUNED = {{")
    for name, K, N in shapes:
        ms = sorted(M for (s, M) in chosen if s == name)
        entries = ", ".join(f"({M}, {cfg_code(chosen[(name, M)])})" for M in ms)
        print(f"    ({N}, {K}): [{entries}],  # {name}")
    print("}")
    if not cub:
        return
    for M in sorted({M for (_, M) in chosen}):
        keys = [k for k in chosen if k[1] == M and k in cub]
        c = sum(cub[k] for k in keys)
        t = sum(cub[k] if chosen[k] is None else chosen[k]["us"] for k in keys)
        print(f"M={M}: one layer's four GEMMs {c:.1f} us cuBLAS -> {t:.1f} us with the table ({c / t:.2f}x)")
    used = [M for (_, M), r in chosen.items() if r is not None]
    print(f"suggested TRITON_MAX_M = {max(used, default=0)}  (the largest M with a Triton entry)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check of the script)")
    ap.add_argument("--no-sweep", action="store_true", help="time cuBLAS and the current picker only")
    ap.add_argument("--full", action="store_true", help="the unpruned sweep (more warps/stages combinations)")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512], help="batch sizes M")
    ap.add_argument("--no-lm-head", action="store_true", help="skip the LM head shape")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.smoke:
        dtype = torch.bfloat16 if CUDA else torch.float16  # the interpreter gets bf16 arithmetic wrong
        shapes, ms, lm = [("tiny_a", 64, 48), ("tiny_b", 96, 32)], [3, 17], None
    else:
        assert CUDA, "the full benchmark needs a GPU (use --smoke on CPU)"
        dtype, shapes, ms, lm = torch.bfloat16, DECODE_SHAPES, args.m, None if args.no_lm_head else LM_HEAD
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 132
    copy_gbs = copy_bandwidth_gbs()
    if copy_gbs:
        tiny = [torch.zeros(16, device="cuda")]
        launch_us = read_us(tiny, 20)
        print(f"device-to-device copy bandwidth: {copy_gbs:.0f} GB/s (read + write); {num_sms} SMs; "
              f"one tiny kernel in a graph: {launch_us:.2f} us")
    rows = []
    for (name, K, N), M in itertools.product(shapes, ms):
        rows += bench_shape(name, K, N, M, dtype, num_sms, copy_gbs, args.smoke, not args.no_sweep, args.full)
        print(f"  {name} M={M} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    if lm:  # information only: the big-N tiles, no split
        for M in ms:
            rows += bench_shape(*lm, M, dtype, num_sms, copy_gbs, False, not args.no_sweep, False)
    table = summary(rows)
    print(f"\nsmall-M GEMM, y = x @ W^T, {str(dtype).replace('torch.', '')}, time per call in a CUDA graph "
          f"(configs: BLOCK_M BLOCK_N BLOCK_K SPLIT_K warps stages)")
    print_table(table, ["shape", "M", "K", "N", "read_us", "cublas_us", "picker_us", "picker_cfg", "best_us",
                        "best_cfg", "ctas", "speedup", "GBps", "TFLOPs", "frac_floor"])  # fmt: skip
    print("(read_us: a kernel that only reads W, same setting; config BMxBNxBK skSPLIT_K warps "
          "stages)")
    if not args.no_sweep:
        suggest(rows, shapes)
    if copy_gbs:
        rows.append({"workload": "copy_bandwidth", "GB/s": copy_gbs, "tiny_kernel_us": launch_us})
    if not args.smoke:
        path = append_jsonl("gemm", rows, env_info())
        print(f"\nappended {len(rows)} lines to {path}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
