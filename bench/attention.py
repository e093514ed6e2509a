"""K1: varlen causal attention forward/backward vs torch SDPA (flash, cuDNN), and paged decode bandwidth.

    python bench/attention.py                            # H200: the K1 shapes and the decode grid below
    python bench/attention.py --bwd-variants             # H200: K1 only, areno with each backward variant
    python bench/attention.py --variants --seqs 4096     # H200: K1 only, areno's forward/backward variant pairs
    TRITON_INTERPRET=1 python bench/attention.py --smoke # CPU: tiny shapes, checks the script (times meaningless)

Training attention: batch 8 sequences of L = 1k, 4k, 8k tokens, 16 query / 8 KV heads, head_dim 128, bf16, causal.
areno runs on the packed [B*L, H, D] layout with cu_seqlens; SDPA runs on [B, H, L, D] with enable_gqa, once per
backend (flash, cuDNN when torch has it). FLOPs count the causal half: forward 4*B*Hq*L^2*D/2, backward 2.5x that.
Times: forward (no autograd graph), backward (autograd.grad of q, k, v from a saved graph), forward+backward.
--bwd-variants: areno runs once per backward variant (attention's ``_bwd``, every value but auto; impl
"areno bwd=<variant>"),
each row with its fwd+bwd and backward-only speed-ups over SDPA flash and cuDNN, and the largest gradient
difference between the variants at the first length is printed; the decode part is skipped.
--variants: the same for the (``_fwd``, ``_bwd``) pairs in VARIANT_PAIRS (impl "areno fwd=<f> bwd=<b>"), plus each
backward's time per kernel (torch profiler) at every length, so a slow kernel shows by name; --pairs
tma:split,tma:tma_merged times only those pairs.
--seqs: the lengths L of those two modes (default 1024 4096 8192).
With --variants the autotuner's time per candidate config of each TMA kernel is printed; --sweep wide autotunes the
d128 TMA forward over a wide candidate list, --sweep near over the chosen tiles' neighbourhood with register caps
(passed to areno/kernels/attention/packed.py ``sweep_candidates``; the production lists stay as they are).

Paged decode: one query per sequence over a context of C tokens in a paged cache (block size 16 and 64, blocks
scattered at random), batch 1/64/256, C = 512/2048. Bytes it must read: K and V of every context token
(B*C*Hkv*D*2*2) plus q, o and the block table; GB/s against the device-to-device copy bandwidth measured in the
same run (read + write bytes / time). Baseline: SDPA decode on a contiguous (unpaged) KV of the same size.
Timed from a CUDA graph replay (as the engine runs decode). A sweep of decode tile configs at batch 256 and of
split counts at batch 1/8 is printed for tuning. One JSON line per measurement: bench/results/attention.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402

from areno.kernels.attention import attention  # noqa: E402
from areno.kernels.attention import packed as attention_module  # noqa: E402
from areno.kernels.attention.paged import paged_attention, paged_attention_triton  # noqa: E402

PEAK_TFLOPS = 790.0  # H200 bf16 dense (BENCH.md)
CUDA = torch.cuda.is_available()


def time_ms(fn, graph=False):
    if not CUDA:
        return gpu_time_ms(fn, warmup=1, iters=2)
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        except Exception as e:  # fall back to eager timing if capture fails
            print(f"  (graph timing failed: {type(e).__name__}: {str(e)[:120]}; timing eagerly)")
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def sdpa_backends():
    if not CUDA:
        return []
    from torch.nn.attention import SDPBackend

    out = [("sdpa flash", SDPBackend.FLASH_ATTENTION)]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        out.append(("sdpa cudnn", SDPBackend.CUDNN_ATTENTION))
    return out


def measure(fwd, inputs):
    """(fwd_ms, bwd_ms, fwdbwd_ms) of ``fwd(*inputs)`` and its gradient w.r.t. inputs."""
    with torch.no_grad():
        t_fwd = time_ms(lambda: fwd(*inputs))
    out = fwd(*inputs)
    g = torch.randn_like(out)
    t_bwd = time_ms(lambda: torch.autograd.grad(out, inputs, g, retain_graph=True))
    t_all = time_ms(lambda: torch.autograd.grad(fwd(*inputs), inputs, g))
    return t_fwd, t_bwd, t_all


# (forward, backward) variant pairs that --variants times: the pointer kernels, the TMA forward beside the pointer
# backward and with the merged TMA backward, then the Gluon forward (today's sm_90 default) with the merged backward
# and with the Gluon backward (the forward's LSE feeds every backward alike, so a forward and a backward can be picked
# independently from these rows).
VARIANT_PAIRS = [("default", "split"), ("tma", "split"), ("tma", "tma_merged"), ("gluon", "tma_merged"),
                 ("gluon", "gluon")]

# --sweep: d128 candidate lists of the TMA forward, (BLOCK_M, BLOCK_N, warps, stages[, maxnreg]): "wide" to choose
# the list in areno/kernels/attention/tma.py from measured times, "near" the chosen tiles' neighbourhood with fewer
# stages and register caps (3 programs per SM for 4-warp tiles at <= 168 registers).
SWEEPS = {
    "wide": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3),
             (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 4, 3), (128, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 3)],
    "near": [(64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 4, 2, 168), (64, 64, 4, 1, 168), (64, 64, 4, 3, 168),
             (64, 64, 4, 2, 200), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4, 168), (32, 64, 4, 2, 168),
             (64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
}


def set_sweep(name):
    """Autotune the d128 TMA forward over SWEEPS[name] (the kernels' own lists otherwise)."""
    from areno.kernels.attention import tma
    from areno.kernels.attention.common import tile_config

    configs = [tile_config(*c[:4], pre_hook=tma.fit_descriptors, maxnreg=c[4] if len(c) > 4 else None)
               for c in SWEEPS[name]]
    attention_module.sweep_candidates("fwd_tma", 128, configs)


def areno_attention(L, cu, variant):
    """areno's attention on the packed layout; ``variant``: None (the defaults), a backward variant name, or a
    (forward, backward) pair, passed as attention's ``_fwd`` / ``_bwd``."""
    fwd, bwd = variant if isinstance(variant, tuple) else (None, variant)

    def fn(q, k, v):
        return attention(q, k, v, cu, cu, L, L, causal=True, _fwd=fwd, _bwd=bwd)
    return fn


def variant_name(variant):
    return f"fwd={variant[0]} bwd={variant[1]}" if isinstance(variant, tuple) else f"bwd={variant}"


def compare_variants(variants, L, cu, q, k, v):
    """Print the largest |output / grad difference| of each variant from the first, relative to the first's size."""
    g = torch.randn_like(q)
    outs = {}
    for var in variants:
        o = areno_attention(L, cu, var)(q, k, v)
        outs[var] = (o.detach(), *torch.autograd.grad(o, (q, k, v), g))
    first = variants[0]
    for var in variants[1:]:
        diffs = [f"{n} {(a.float() - b.float()).abs().max().item() / b.float().abs().max().item():.2e}"
                 for n, a, b in zip(("o", "dq", "dk", "dv"), outs[var], outs[first])]
        print(f"  L={L}: max |{variant_name(var)} - {variant_name(first)}| / max |first|: " + ", ".join(diffs))


def backward_kernel_times(fn, inputs, reps=5):
    """{kernel name: ms per backward} of ``fn``'s backward from the torch profiler (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    out = fn(*inputs)
    g = torch.randn_like(out)
    torch.autograd.grad(out, inputs, g, retain_graph=True)  # warm (autotuned already by measure())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.autograd.grad(out, inputs, g, retain_graph=True)
        torch.cuda.synchronize()
    times = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if us > 0:
            times[evt.key] = us / 1e3 / reps
    return times


def bench_training(seqs, batch, hq, hkv, d, dtype, bwd_variants=None):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    dev = "cuda" if CUDA else "cpu"
    rows = []
    for L in seqs:
        flops = 4 * batch * hq * L * L * d / 2
        q = torch.randn(batch * L, hq, d, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(batch * L, hkv, d, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(batch * L, hkv, d, device=dev, dtype=dtype, requires_grad=True)
        cu = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * L
        if bwd_variants:
            impls = [(f"areno {variant_name(var)}", areno_attention(L, cu, var), (q, k, v)) for var in bwd_variants]
            if L == seqs[0]:
                compare_variants(bwd_variants, L, cu, q, k, v)
        else:
            impls = [("areno", areno_attention(L, cu, None), (q, k, v))]
        qb, kb, vb = (t.detach().view(batch, L, -1, d).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        for name, backend in sdpa_backends():
            def run(q, k, v, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            impls.append((name, run, (qb, kb, vb)))
        base, base_bwd = {}, {}
        for name, fn, inputs in impls:
            try:
                t_fwd, t_bwd, t_all = measure(fn, inputs)
            except Exception as e:
                print(f"  {name} L={L}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            base[name], base_bwd[name] = t_all, t_bwd
            variant = name.split("bwd=")[1] if "bwd=" in name else None
            fwd_variant = name.split("fwd=")[1].split()[0] if "fwd=" in name else None
            rows.append({
                "workload": "K1", "impl": name, "seq": L, "batch": batch, "heads_q": hq, "heads_kv": hkv,
                "head_dim": d, "dtype": str(dtype).replace("torch.", ""),
                **({"bwd_variant": variant} if variant else {}),
                **({"fwd_variant": fwd_variant} if fwd_variant else {}),
                "fwd_ms": t_fwd, "bwd_ms": t_bwd, "fwdbwd_ms": t_all,
                "fwd_tflops": flops / t_fwd / 1e9, "bwd_tflops": 2.5 * flops / t_bwd / 1e9,
                "fwdbwd_tflops": 3.5 * flops / t_all / 1e9, "fwdbwd_frac_peak": 3.5 * flops / t_all / 1e9 / PEAK_TFLOPS,
            })  # fmt: skip
        for r in rows:
            if r["seq"] == L:
                for b in ("sdpa flash", "sdpa cudnn"):
                    if b in base:
                        r[f"speedup_vs_{b.split()[1]}"] = base[b] / r["fwdbwd_ms"]
                        if bwd_variants:
                            r[f"bwd_speedup_vs_{b.split()[1]}"] = base_bwd[b] / r["bwd_ms"]
        if CUDA and L == seqs[0]:  # sanity: same answer as flash
            with torch.no_grad():
                a = attention(q, k, v, cu, cu, L, L).float()
                with sdpa_kernel(sdpa_backends()[0][1]):
                    b = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
            err = (a - b.transpose(1, 2).reshape_as(a).float()).abs().max()
            print(f"  L={L}: max |areno - sdpa flash| = {err:.3g}")
        if bwd_variants and CUDA:
            for kind in ("fwd_tma", "bwd_merged_tma"):
                print_config_timings(kind, L)
            for name, fn, inputs in impls:
                if name.startswith("areno"):
                    times = backward_kernel_times(fn, inputs)
                    top = sorted(times.items(), key=lambda kv: -kv[1])[:6]
                    print(f"  L={L} {name} backward per kernel: "
                          + ", ".join(f"{k[:48]} {t:.3f} ms" for k, t in top))
        del q, k, v, qb, kb, vb
    return rows


def copy_bandwidth_gbs():
    if not CUDA:
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = time_ms(lambda: y.copy_(x))
    return 2 * x.numel() / t / 1e6


def make_paged(batch, ctx, hq, hkv, d, page, dtype, dev, fp8=False):
    """A decode problem over a paged cache: (q, k_cache, v_cache, table, lens, nbytes, scales); ``fp8``: an FP8
    cache (E4M3 K/V, one fp32 scale per slot and KV head, ``scales`` the kernel's k_scale / v_scale keywords)."""
    blocks_per_seq = triton.cdiv(ctx, page)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, page, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, device=dev, dtype=dtype)
    scales = {}
    if fp8:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        scales = {name: torch.rand(num_blocks, page, hkv, device=dev) + 0.5 for name in ("k_scale", "v_scale")}
    table = torch.randperm(num_blocks, device=dev).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    nbytes = 2 * batch * ctx * hkv * (d * k_cache.element_size() + (4 if fp8 else 0))
    nbytes += 2 * batch * hq * d * q.element_size() + table.numel() * 4
    return q, k_cache, v_cache, table, lens, nbytes, scales


def decode_row(impl, fn, nbytes, copy_gbs, **info):
    t = time_ms(fn, graph=True)
    gbs = nbytes / t / 1e6
    return {"workload": "paged_decode", "impl": impl, **info, "ms": t, "GB/s": gbs,
            "frac_copy_bw": gbs / copy_gbs if copy_gbs else None}


def bench_decode(batches, ctxs, pages, hq, hkv, d, dtype, copy_gbs):
    import torch.nn.functional as F

    dev = "cuda" if CUDA else "cpu"
    rows = []
    for batch, ctx, page in itertools.product(batches, ctxs, pages):
        q, k_cache, v_cache, table, lens, nbytes, _ = make_paged(batch, ctx, hq, hkv, d, page, dtype, dev)
        info = dict(batch=batch, ctx=ctx, heads_q=hq, heads_kv=hkv, head_dim=d)
        rows.append(decode_row("areno", lambda a=(q, k_cache, v_cache, table, lens): paged_attention(*a), nbytes,
                               copy_gbs, block_size=page, **info))
        if page == pages[0]:  # baseline once per (batch, ctx): SDPA over an unpaged, contiguous KV
            kd = k_cache.view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
            vd = v_cache.view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
            sdpa = lambda a=(q[:, :, None], kd, vd): F.scaled_dot_product_attention(*a, enable_gqa=True)
            try:
                rows.append(decode_row("sdpa (contiguous KV)", sdpa, nbytes, copy_gbs, block_size=None, **info))
            except Exception as e:
                print(f"  sdpa decode batch={batch} ctx={ctx}: failed: {type(e).__name__}: {str(e)[:160]}")
    return rows


def sweep_row(paged, splits, cfg, copy_gbs, **fields):
    """Time one kernel config (``cfg`` (BLOCK_M, BLOCK_N, warps, stages) or None) and split count on the decode
    problem ``paged`` (from make_paged) in a CUDA graph; a sweep row, or None if it failed."""
    q, k_cache, v_cache, table, lens, nbytes, scales = paged
    args = (q, k_cache, v_cache, table, lens, q.shape[-1] ** -0.5, None, 1, splits, cfg)
    try:
        t = time_ms(lambda: paged_attention_triton(*args, **scales), graph=True)
    except Exception as e:
        print(f"  {fields} splits {splits} config {cfg}: failed: {type(e).__name__}: {str(e)[:120]}")
        return None
    gbs = nbytes / t / 1e6
    return {**fields, "block_size": 16, "ms": t, "GB/s": gbs, "frac_copy_bw": gbs / copy_gbs if copy_gbs else None}


def sweep_decode(hq, hkv, d, dtype, copy_gbs, big_batch=256, ctx=2048, small_batches=(1, 8)):
    """Tile configs at batch 256 / ctx 2048 / block 16, and split counts at batch 1 and 8 / ctx 2048."""
    rows = []
    dev = "cuda" if CUDA else "cpu"
    runs = [(big_batch, 1, (16, bn, w, s)) for bn, w, s in itertools.product([32, 64, 128], [4, 8], [2, 3])]
    runs += [(batch, splits, None) for batch in small_batches for splits in (1, 2, 4, 8, 16)]
    made = {}
    for batch, splits, cfg in runs:
        if batch not in made:
            made = {batch: make_paged(batch, ctx, hq, hkv, d, 16, dtype, dev)}  # drop the previous cache
        name = f"splits={splits}" if cfg is None else f"BLOCK_N={cfg[1]} warps={cfg[2]} stages={cfg[3]}"
        row = sweep_row(made[batch], splits, cfg, copy_gbs, workload="paged_decode_sweep", batch=batch, ctx=ctx,
                        config=name)
        rows += [row] if row else []
    return rows


def sweep_rollout_decode(hq, hkv, d, dtype, copy_gbs, batch=256, ctxs=(160, 384, 640), kv_dtypes=("bf16",)):
    """Tile configs and split counts at the contexts of an RL rollout (batch 256, 128 + up to 512 tokens), for
    each KV cache dtype of ``kv_dtypes`` (bf16: the model's; fp8: ``--kv-cache-dtype fp8``'s E4M3 with scales)."""
    rows = []
    dev = "cuda" if CUDA else "cpu"
    configs = list(itertools.product([32, 64, 128], [4, 8], [2, 3, 4]))
    for kv, ctx in itertools.product(kv_dtypes, ctxs):
        paged = make_paged(batch, ctx, hq, hkv, d, 16, dtype, dev, fp8=kv == "fp8")
        mine = []
        for (bn, w, st), splits in itertools.product(configs, (1, 2)):
            row = sweep_row(paged, splits, (16, bn, w, st), copy_gbs, workload="paged_decode_rollout_sweep",
                            batch=batch, ctx=ctx, kv_cache_dtype=kv,
                            config=f"BLOCK_N={bn} warps={w} stages={st} splits={splits}")
            mine += [row] if row else []
        default = sweep_row(paged, None, None, copy_gbs, workload="paged_decode_rollout_default", batch=batch,
                            ctx=ctx, kv_cache_dtype=kv, config="default")
        best = max(mine, key=lambda r: r["GB/s"], default=None)
        if best and default:
            print(f"  rollout sweep {kv} ctx {ctx}: best {best['config']} {best['ms'] * 1e3:.1f} us "
                  f"{best['GB/s']:.0f} GB/s; default config {default['ms'] * 1e3:.1f} us {default['GB/s']:.0f} GB/s")
        rows += mine + ([default] if default else [])
        del paged
    return rows


K1_COLUMNS = ["impl", "seq", "fwd_ms", "bwd_ms", "fwdbwd_ms", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops",
              "speedup_vs_flash", "speedup_vs_cudnn"]


def print_tuned_configs():
    print("\nautotuned attention configs (key -> config):")
    for kind in ("fwd", "dkdv", "dq", "fwd_tma", "bwd_merged_tma"):
        for key, cfg in attention_module.autotuned(kind, 128).cache.items():
            print(f"  {kind} {key}: {cfg}")


def print_config_timings(kind, L):
    """The autotuner's time per candidate config of ``kind`` (d128) at its last new key (here: length L)."""
    timings = getattr(attention_module.autotuned(kind, 128), "configs_timings", None) or {}
    for cfg, t in sorted(timings.items(), key=lambda kv: kv[1][0] if isinstance(kv[1], list) else kv[1]):
        print(f"  L={L} {kind} {cfg}: {t}")


def bench_bwd_variants(smoke, variants, seqs, batch=8):
    """K1 with areno's variants side by side (same inputs, same SDPA baselines, same run); ``batch`` sequences of
    each length (K1: 8; T2's attention: 4)."""
    if smoke:
        dtype = torch.float16 if not CUDA else torch.bfloat16
        rows = bench_training([64], 2, 4, 2, 64, dtype, bwd_variants=variants)
    else:
        assert CUDA, "the full benchmark needs a GPU (use --smoke on CPU)"
        rows = bench_training(seqs, batch, 16, 8, 128, torch.bfloat16, bwd_variants=variants)
    print("\nK1 attention, areno variants (varlen causal, fwd / bwd / fwd+bwd)")
    print_table(rows, K1_COLUMNS + ["bwd_speedup_vs_flash", "bwd_speedup_vs_cudnn"])
    if CUDA:
        print_tuned_configs()
    if not smoke:
        path = append_jsonl("attention", rows, env_info())
        print(f"\nappended {len(rows)} lines to {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check of the script)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the decode config / split sweep")
    ap.add_argument("--rollout-sweep", action="store_true",
                    help="only the decode config sweep at rollout contexts (batch 256, ctx 160 / 384 / 640)")
    ap.add_argument("--ctxs", default=None,
                    help="--rollout-sweep only: contexts, comma-separated (default 160,384,640)")
    ap.add_argument("--kv-cache-dtypes", default="bf16",
                    help="--rollout-sweep only: the KV cache dtypes to sweep, comma-separated (bf16, fp8)")
    ap.add_argument("--bwd-variants", action="store_true",
                    help="K1 only: areno once per backward variant (attention's _bwd, all of BWD_VARIANTS) beside "
                         "SDPA")
    ap.add_argument("--variants", action="store_true",
                    help="K1 only: areno once per (_fwd, _bwd) pair of VARIANT_PAIRS beside SDPA")
    ap.add_argument("--sweep", choices=sorted(SWEEPS), default=None,
                    help="--variants only: autotune the d128 TMA forward over this candidate list (times printed)")
    ap.add_argument("--seqs", type=int, nargs="+", default=None,
                    help="K1 lengths for --variants / --bwd-variants (default 1024 4096 8192)")
    ap.add_argument("--pairs", default=None,
                    help="--variants only: the FWD:BWD pairs to time, comma-separated (default: all of VARIANT_PAIRS)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per length for --variants / --bwd-variants (default 8, K1; 4 is T2's attention)")
    args = ap.parse_args()
    if args.bwd_variants and args.variants:
        ap.error("--bwd-variants and --variants are two modes: pick one")
    if args.seqs is not None and not (args.bwd_variants or args.variants) or args.seqs and args.smoke:
        ap.error("--seqs applies to the full --variants / --bwd-variants runs only")
    if args.batch is not None and (not (args.bwd_variants or args.variants) or args.smoke or args.batch < 1):
        ap.error("--batch (>= 1) applies to the full --variants / --bwd-variants runs only")
    if args.sweep and not args.variants:
        ap.error("--sweep applies to --variants only")
    if args.bwd_variants or args.variants:
        if args.sweep:
            set_sweep(args.sweep)
        if args.rollout_sweep or args.no_sweep:
            ap.error("--variants / --bwd-variants run K1 only: --rollout-sweep / --no-sweep do not apply to them")
        explicit = [v for v in attention_module.BWD_VARIANTS if v != "auto"]  # auto is one of them per device
        variants = list(VARIANT_PAIRS) if args.variants else explicit
        if args.pairs is not None:
            if not args.variants:
                ap.error("--pairs applies to --variants only")
            variants = [tuple(p.split(":")) for p in args.pairs.split(",")]
            bad = [p for p in variants if len(p) != 2 or p[0] not in attention_module.FWD_VARIANTS
                   or p[1] not in attention_module.BWD_VARIANTS]
            if bad:
                ap.error(f"--pairs: each pair is FWD:BWD with FWD in {attention_module.FWD_VARIANTS} and BWD in "
                         f"{attention_module.BWD_VARIANTS}, got {args.pairs!r}")
        bench_bwd_variants(args.smoke, variants, args.seqs or [1024, 4096, 8192], args.batch or 8)
        return
    kv_dtypes = tuple(args.kv_cache_dtypes.split(","))
    if not set(kv_dtypes) <= {"bf16", "fp8"} or (kv_dtypes != ("bf16",) and not args.rollout_sweep):
        ap.error("--kv-cache-dtypes takes bf16 and/or fp8, and applies to --rollout-sweep only")
    if args.ctxs is not None and not args.rollout_sweep:
        ap.error("--ctxs applies to --rollout-sweep only")
    if args.rollout_sweep:
        dtype = torch.bfloat16 if CUDA else torch.float16
        shape = (16, 8, 128) if CUDA else (4, 2, 64)
        copy_gbs = copy_bandwidth_gbs() if CUDA else None
        rows = sweep_rollout_decode(*shape, dtype, copy_gbs, kv_dtypes=kv_dtypes,
                                    **({} if CUDA else dict(batch=2, ctxs=(40,))),
                                    **({} if args.ctxs is None else dict(ctxs=tuple(map(int, args.ctxs.split(","))))))
        print_table(rows, ["kv_cache_dtype", "ctx", "config", "ms", "GB/s", "frac_copy_bw"])
        if CUDA:
            append_jsonl("attention", rows, env_info())
        return
    if args.smoke:
        dtype = torch.float16 if not CUDA else torch.bfloat16  # the interpreter gets bf16 arithmetic wrong
        train = bench_training([64], 2, 4, 2, 64, dtype)
        decode = bench_decode([2], [40], [16], 4, 2, 64, dtype, None)
        sweep = [] if args.no_sweep else sweep_decode(4, 2, 64, dtype, None, big_batch=2, ctx=40, small_batches=(1,))
    else:
        assert CUDA, "the full benchmark needs a GPU (use --smoke on CPU)"
        train = bench_training([1024, 4096, 8192], 8, 16, 8, 128, torch.bfloat16)
        copy_gbs = copy_bandwidth_gbs()
        print(f"device-to-device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
        decode = bench_decode([1, 64, 256], [512, 2048], [16, 64], 16, 8, 128, torch.bfloat16, copy_gbs)
        sweep = [] if args.no_sweep else sweep_decode(16, 8, 128, torch.bfloat16, copy_gbs)
        decode.append({"workload": "copy_bandwidth", "GB/s": copy_gbs})

    print("\nK1 attention (varlen causal, fwd / bwd / fwd+bwd)")
    print_table(train, K1_COLUMNS)
    print("\npaged decode")
    print_table([r for r in decode if r["workload"] == "paged_decode"],
                ["impl", "batch", "ctx", "block_size", "ms", "GB/s", "frac_copy_bw"])
    if sweep:
        print("\npaged decode sweep (areno kernel configs)")
        print_table(sweep, ["batch", "config", "ms", "GB/s", "frac_copy_bw"])
    if CUDA:
        print_tuned_configs()
    if not args.smoke:
        path = append_jsonl("attention", train + decode + sweep, env_info())
        print(f"\nappended {len(train) + len(decode) + len(sweep)} lines to {path}")


if __name__ == "__main__":
    main()
