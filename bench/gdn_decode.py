"""Qwen3.5's fused gated-DeltaNet decode step (kernels/linear_attn/gdn_decode.py) at the 9B decode shape, against
the memory limit and the layer's unfused path in the same process.

    python bench/gdn_decode.py                            # GPU: 256 rows, 16 key / 32 value heads of 128
    python bench/gdn_decode.py --rows 64 --verify-tokens 3 --bv 32,64,128 --warps 2,4,8  # speculation's verify too
    TRITON_INTERPRET=1 python bench/gdn_decode.py --smoke # CPU: tiny shapes, checks the script (times meaningless)

One layer's step over B rows of a state pool (slots permuted). A step must read and write each row's state
(nv x dk x dv, 2 MB a row in fp32 at the 9B shape), so its floor is those bytes at HBM speed; GB/s counts state read +
written plus q/k/v/a/b read and o written. Rows: the unfused path (``gdn_decode_step_native``: ~20 PyTorch kernels,
the baseline), then the Triton kernel for every tile of the sweep (BV value columns a program, warps), fp32 and bf16
state pools. The fastest tile of each state dtype is the one to set in ``STEP_CONFIG``. One JSON line per row:
bench/results/gdn_decode.jsonl.

``--verify-tokens n`` also times each tile's speculative verify as the engine runs it (rows ``impl``
"triton-verify"): ``gdn_verify_steps`` with its inputs kept (n tokens a row, the state read once, nothing written;
``ms_verify``) and then ``gdn_replay`` committing each row's accepted tokens (a count drawn in 1..n a row; the state
read and written once; ``ms_replay``), ``ms`` their sum, against 3 state passes. Both must share the step kernel's
tile (their results are bit-equal to n steps only then). Compiled offline with Triton 3.7.1's ptxas the step's fp32
tile (BV 128, 4 warps) keeps 32 registers and 4.4 KB of stack a thread, BV 64 with 4 warps 0.3 KB, BV 32 none.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402

from areno.kernels.linear_attn import gdn_decode  # noqa: E402
from areno.kernels.linear_attn.steps import VerifyInputs  # noqa: E402

CUDA = torch.cuda.is_available()
HBM_TBS = {"H100": 3.35, "H200": 4.8}  # peak memory bandwidth by card


def time_ms(fn):
    if not CUDA:
        return gpu_time_ms(fn, warmup=0, iters=1)
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")


def make(B, nk, nv, K, V, state_dtype, dev, tokens=1):
    """Inputs of ``tokens`` rows for each of B sequences, and B state slots in a shuffled order."""
    g = torch.Generator(device=dev).manual_seed(0)
    cols = 2 * nk * K + nv * V
    proj = torch.randn(B * tokens, cols + 2 * nv, device=dev, generator=g).bfloat16()
    qkv, a, b = proj[:, :cols].contiguous(), proj[:, cols : cols + nv], proj[:, cols + nv :]
    A_log, dt_bias = torch.randn(nv, device=dev) * 0.5, torch.randn(nv, device=dev)
    pool = (torch.randn(B, nv, K, V, device=dev, generator=g) * 0.3).to(state_dtype)
    idx = torch.randperm(B, device=dev, generator=g).to(torch.int32)
    return qkv, a, b, A_log, dt_bias, pool, idx


def measure(impl, B, nk, nv, K, V, state_dtype, config, peak, n=1):
    """One row: ``impl`` "native" / "triton" (a decode step of B rows) or "triton-verify" (``n`` tokens each of B
    rows through ``gdn_verify_steps`` with its inputs kept, then ``gdn_replay`` of a count in 1..n a row)."""
    dev = "cuda" if CUDA else "cpu"
    qkv, a, b, A_log, dt_bias, pool, idx = make(B, nk, nv, K, V, state_dtype, dev, tokens=n)
    kw = dict(num_k_heads=nk, num_v_heads=nv, state_indices=idx)
    if config:
        gdn_decode.STEP_CONFIG[state_dtype] = config
    parts = {}
    if impl == "triton-verify":
        keep, counts = VerifyInputs(B * n), torch.randint(1, n + 1, (B,), dtype=torch.int32, device=dev)
        parts["ms_verify"] = time_ms(lambda: gdn_decode.gdn_verify_steps(qkv, a, b, A_log, dt_bias, pool, n=n,
                                                                         keep=keep, **kw))  # fmt: skip
        parts["ms_replay"] = time_ms(lambda: keep.replay(pool, idx, counts))
        ms = parts["ms_verify"] + parts["ms_replay"]
    else:
        fn = gdn_decode.gdn_decode_step if impl == "triton" else gdn_decode.gdn_decode_step_native
        ms = time_ms(lambda: fn(qkv, a, b, A_log, dt_bias, pool, **kw))
    passes = 3 if impl == "triton-verify" else 2  # the state read and written (a verify: read, then the replay's)
    moved = passes * pool.numel() * pool.element_size() + qkv.numel() * 2 + 4 * B * n * nv + B * n * nv * V * 2
    gbs = moved / ms / 1e6
    return {"impl": impl, "rows": B, "tokens": n, "k_heads": nk, "v_heads": nv, "dk": K, "dv": V,
            "state_dtype": str(state_dtype).removeprefix("torch."), **(config or {}), "ms": round(ms, 4),
            **{k: round(v, 4) for k, v in parts.items()}, "gb_s": round(gbs, 1),
            "hbm_frac": round(gbs / (peak * 1000), 3) if peak else None}  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--bv", default="16,32,64,128", help="value columns a program, swept")
    ap.add_argument("--warps", default="1,2,4,8", help="warps a program, swept")
    ap.add_argument("--verify-tokens", type=int, default=0,
                    help="n > 1: also each tile's speculative verify of n tokens a row (K + 1; 0: off)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.verify_tokens == 1 or args.verify_tokens < 0:
        ap.error(f"--verify-tokens: tokens a row, 2 or more (K + 1), or 0 for none; got {args.verify_tokens}")
    B, nk, nv, K, V = (args.rows, 16, 32, 128, 128) if not args.smoke else (3, 2, 4, 16, 32)
    env = env_info()
    name = torch.cuda.get_device_name() if CUDA else ""
    peak = next((v for k, v in HBM_TBS.items() if k in name), None)
    default = {k: dict(v) for k, v in gdn_decode.STEP_CONFIG.items()}
    rows = [measure("native", B, nk, nv, K, V, torch.float32, None, peak)]
    sweep = [(bv, w) for bv in map(int, args.bv.split(",")) for w in map(int, args.warps.split(","))]
    for state_dtype in (torch.float32, torch.bfloat16):
        for bv, w in sweep if not args.smoke else sweep[:2]:
            try:
                rows.append(measure("triton", B, nk, nv, K, V, state_dtype, {"BV": bv, "num_warps": w}, peak))
                if args.verify_tokens > 1:
                    rows.append(measure("triton-verify", B, nk, nv, K, V, state_dtype, {"BV": bv, "num_warps": w},
                                        peak, args.verify_tokens))  # fmt: skip
            except Exception as e:  # a tile that does not compile is a row, not the end of the sweep
                rows.append({"impl": "triton", "state_dtype": str(state_dtype), "BV": bv, "num_warps": w,
                             "error": repr(e)[:200]})  # fmt: skip
    gdn_decode.STEP_CONFIG.update(default)
    print_table(rows, ["impl", "tokens", "state_dtype", "BV", "num_warps", "ms", "ms_verify", "ms_replay", "gb_s",
                       "hbm_frac", "error"])
    for sd in ("float32", "bfloat16"):
        for impl in ("triton", "triton-verify"):
            ok = [r for r in rows if r["impl"] == impl and "ms" in r and r["state_dtype"] == sd]
            if ok:
                best = min(ok, key=lambda r: r["ms"])
                print(f"best {sd} tile of {impl}: BV={best['BV']} warps={best['num_warps']} {best['ms']} ms "
                      f"{best['gb_s']} GB/s ({rows[0]['ms'] / best['ms']:.1f}x the unfused fp32 step)")
    print("STEP_CONFIG now:", default)
    if not args.no_save and not args.smoke:
        print("results:", append_jsonl("gdn_decode", rows, env))


if __name__ == "__main__":
    main()
