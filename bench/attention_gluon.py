"""Every candidate of the Gluon attention kernels (``areno/kernels/attention_gluon.py``) timed at K1 (8 x 4096,
16/8 heads, d128, causal, bf16) beside the kernels they replace, in one process:

- forward: each Gluon candidate (plain and warp-specialized) vs the Triton TMA forward (autotuned) and SDPA cuDNN's
  forward; its O and LSE compared with the TMA forward's;
- dQ: each Gluon dQ candidate; dK/dV: each Gluon dK/dV candidate (the Triton kernels they replace are timed by
  ``bench/attention.py --variants``, per kernel);
- each kernel's TFLOP/s counts the causal half (forward 4 B H L^2 D / 2; dQ 1.5x that, dK/dV 2x).

    python bench/attention_gluon.py [--rounds 2] [--parts fwd,dq,dkdv]

Needs an sm_90 GPU and a Triton with Gluon (no interpreter). Results: ``bench/results/attention_gluon.jsonl``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, print_table  # noqa: E402

from areno.kernels import attention_gluon as g  # noqa: E402

A = importlib.import_module("areno.kernels.attention")
LOG2E = 1.4426950408889634


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="passes over every candidate (the H200 moves its clocks)")
    ap.add_argument("--parts", default="fwd,dq,dkdv")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or not g.available():
        sys.exit("bench/attention_gluon.py needs an sm_90 GPU and a Triton with Gluon (Gluon has no interpreter)")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, L, HQ, HK, D = 8, 4096, 16, 8, 128
    dev, dt = "cuda", torch.bfloat16
    q, do = (torch.randn(B * L, HQ, D, device=dev, dtype=dt) for _ in range(2))
    k, v = (torch.randn(B * L, HK, D, device=dev, dtype=dt) for _ in range(2))
    cu = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * L
    scale = D**-0.5
    flops = 4 * B * HQ * L * L * D / 2
    ref_o, ref_lse = A._attention_fwd(q, k, v, cu, cu, L, L, True, scale, "tma")
    delta = (ref_o.float() * do.float()).sum(-1).t().contiguous()
    qb, kb, vb = (t.view(B, L, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)

    records = []

    def timed(rnd, kernel, name, fn, work, **extra):
        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
        records.append(dict(round=rnd, kernel=kernel, impl=name, ms=round(ms, 4),
                            tflops=round(work / ms / 1e9, 1), **extra))

    def candidate(cfg):
        return f"gluon {cfg.kwargs} w{cfg.num_warps}" + (f" r{cfg.maxnreg}" if cfg.maxnreg else "")

    g.FORCE_CONFIG.clear()
    for rnd in range(args.rounds):
        if "fwd" in parts:
            timed(rnd, "fwd", "sdpa cudnn", cudnn, flops)
            timed(rnd, "fwd", "triton tma (autotuned)",
                  lambda: A._attention_fwd(q, k, v, cu, cu, L, L, True, scale, "tma"), flops)
            for cfg in g.CONFIGS[D]:
                g.FORCE_CONFIG["fwd"] = cfg
                fn = lambda: A._attention_fwd(q, k, v, cu, cu, L, L, True, scale, "gluon")  # noqa: E731
                o, lse = fn()
                err = max((o.float() - ref_o.float()).abs().max().item(), (lse - ref_lse).abs().max().item())
                timed(rnd, "fwd", candidate(cfg), fn, flops, max_diff_vs_tma=err)
            g.FORCE_CONFIG.clear()
        if "dq" in parts:
            dq_first = None
            for cfg in g.DQ_CONFIGS[D]:
                g.FORCE_CONFIG["dq"] = cfg
                dq = torch.empty_like(q)
                fn = lambda dq=dq: g.backward_dq(q, k, v, do, dq, ref_lse, delta, cu, cu, L, L, True,  # noqa: E731
                                                 scale * LOG2E, scale)
                fn()
                dq_first = dq.clone() if dq_first is None else dq_first
                timed(rnd, "dq", candidate(cfg), fn, 1.5 * flops,
                      max_diff_vs_first=(dq.float() - dq_first.float()).abs().max().item())
            g.FORCE_CONFIG.clear()
        if "dkdv" in parts:
            first = None
            for cfg in g.DKDV_CONFIGS[D]:
                g.FORCE_CONFIG["dkdv"] = cfg
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                fn = lambda dk=dk, dv=dv: g.backward_dkdv(q, k, v, do, dk, dv, ref_lse, delta, cu, cu, L, L,  # noqa: E731
                                                          True, scale * LOG2E, scale)
                fn()
                first = torch.cat([dk, dv]).clone() if first is None else first
                timed(rnd, "dkdv", candidate(cfg), fn, 2 * flops,
                      max_diff_vs_first=(torch.cat([dk, dv]).float() - first.float()).abs().max().item())
            g.FORCE_CONFIG.clear()
    print_table(records, ["round", "kernel", "impl", "ms", "tflops", "max_diff_vs_tma", "max_diff_vs_first"])
    print(f"results: {append_jsonl('attention_gluon', records)}")


if __name__ == "__main__":
    main()
