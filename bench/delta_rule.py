"""Gated delta rule (KDA) training kernel: Triton chunked forward+backward vs the native chunked PyTorch path.

    python bench/delta_rule.py                            # H200: L = 4k and 32k, H = 16 and 32, K = V = 128, bf16
    TRITON_INTERPRET=1 python bench/delta_rule.py --smoke # CPU: tiny shapes, checks the script (times meaningless)

One packed sequence of L tokens (the long-context case where the sequential state pass matters most), chunk 64,
per-channel gates (KDA) and, at H = 16, per-head gates (Gated DeltaNet). Inputs as the model feeds them: unit-norm
q/k, g in [-5, 0] (KDA's lower bound), beta in (0, 1), no initial state. Times: forward (no graph) and
forward+backward (grads of q, k, v, g, beta); tokens/s = L / fwd+bwd time. FLOPs (matmul work of the chunked
algorithm, per token and head, C = 64): forward 2 * (3CK + 2CV + 3KV), backward counted as 2x forward; TFLOP/s
is reported against the 790 TFLOP/s bf16 peak only as an indication (the kernels run fp32/tf32 math inside).
Baseline in the same run: ``chunk_gated_delta_rule_native`` (fp32 PyTorch, autograd). The max |Triton - native|
of the output is printed per shape. One JSON line per measurement: bench/results/delta_rule.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402

from areno.kernels.linear_attn.delta_rule import chunk_gated_delta_rule, chunk_gated_delta_rule_native  # noqa: E402

CUDA = torch.cuda.is_available()
PEAK_TFLOPS = 790.0


def time_ms(fn):
    if not CUDA:
        return gpu_time_ms(fn, warmup=0, iters=1)
    return triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median")


def make_inputs(L, H, K, V, gate, dtype, dev):
    q = F.normalize(torch.randn(L, H, K, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(L, H, K, device=dev), dim=-1).to(dtype)
    v = torch.randn(L, H, V, device=dev, dtype=dtype)
    g = -5 * torch.sigmoid(torch.randn(L, H, *((K,) if gate == "channel" else ()), device=dev))
    beta = torch.sigmoid(torch.randn(L, H, device=dev)).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def bench_shape(impl, L, H, K, V, gate, dtype, C):
    dev = "cuda" if CUDA else "cpu"
    ts = make_inputs(L, H, K, V, gate, dtype, dev)
    fn = chunk_gated_delta_rule if impl == "triton" else chunk_gated_delta_rule_native
    run = lambda: fn(*ts, chunk_size=C)[0]
    do = torch.randn(L, H, V, device=dev, dtype=dtype)

    def fwd():
        with torch.no_grad():
            run()

    def fwdbwd():
        torch.autograd.grad(run(), ts, do)

    try:
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        fwd_ms, fb_ms = time_ms(fwd), time_ms(fwdbwd)
    except torch.OutOfMemoryError:
        print(f"  {impl} L={L} H={H}: out of memory")
        return None, None
    with torch.no_grad():
        out = run().float()
    flops_tok = 2 * (3 * C * K + 2 * C * V + 3 * K * V) * H
    row = {"workload": "delta_rule_fwdbwd", "impl": impl, "gate": gate, "seq": L, "heads": H, "K": K, "V": V,
           "chunk": C, "dtype": str(dtype).removeprefix("torch."), "fwd_ms": fwd_ms, "fwdbwd_ms": fb_ms,
           "tokens_per_s": L / fb_ms * 1e3, "fwdbwd_tflops": 3 * flops_tok * L / fb_ms / 1e9,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else None}
    row["frac_peak"] = row["fwdbwd_tflops"] / PEAK_TFLOPS
    return row, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check of the script)")
    args = ap.parse_args()
    if args.smoke:
        shapes = [(40, 1, 16, 16, "channel"), (40, 1, 16, 16, "head")]
        dtype, C = torch.float32, 16
    else:
        assert CUDA, "the full benchmark needs a GPU (use --smoke on CPU)"
        shapes = [(L, H, 128, 128, gate) for L in (4096, 32768) for H in (16, 32) for gate in ("channel", "head")
                  if gate == "channel" or H == 16]
        dtype, C = torch.bfloat16, 64
    rows = []
    for L, H, K, V, gate in shapes:
        torch.manual_seed(0)
        tri, out_t = bench_shape("triton", L, H, K, V, gate, dtype, C)
        torch.manual_seed(0)
        nat, out_n = bench_shape("native", L, H, K, V, gate, dtype, C)
        if tri and nat:
            tri["speedup_vs_native"] = nat["fwdbwd_ms"] / tri["fwdbwd_ms"]
            err = (out_t - out_n).abs().max().item()
            print(f"  L={L} H={H} gate={gate}: max |triton - native| = {err:.3g}")
            tri["max_abs_diff_vs_native"] = err
        rows += [r for r in (tri, nat) if r]
        if CUDA:
            torch.cuda.empty_cache()
    print("\ngated delta rule, chunked, fwd+bwd")
    print_table(rows, ["impl", "gate", "seq", "heads", "fwd_ms", "fwdbwd_ms", "tokens_per_s", "fwdbwd_tflops",
                       "peak_gib", "speedup_vs_native"])
    if not args.smoke:
        path = append_jsonl("delta_rule", rows, env_info())
        print(f"\nappended {len(rows)} lines to {path}")


if __name__ == "__main__":
    main()
