"""Every candidate of the Gluon attention kernels (``areno/kernels/attention/gluon.py``) timed at K1 (8 x 4096,
16/8 heads, d128, causal, bf16) beside the kernels they replace, in one process:

- forward: each Gluon candidate (plain and warp-specialized) vs the Triton TMA forward (autotuned) and SDPA cuDNN's
  forward; its O and LSE compared with the TMA forward's;
- bwd: the whole backward (delta, kernels, dQ cast) with each candidate of the single-pass Gluon kernel vs the
  merged Triton backward and SDPA cuDNN's backward (autograd through its forward), dQ / dK / dV compared with the
  merged backward's;
- each kernel's TFLOP/s counts the causal half (forward 4 B H L^2 D / 2, backward 2.5x that).

    python bench/attention_gluon.py [--rounds 2] [--parts fwd,bwd]

Needs an sm_90 GPU and a Triton with Gluon (no interpreter). Results: ``bench/results/attention_gluon.jsonl``.
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

from common import append_jsonl, print_table  # noqa: E402

from areno.kernels.attention import gluon as g  # noqa: E402
from areno.kernels.attention import packed as A  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="passes over every candidate (the H200 moves its clocks)")
    ap.add_argument("--parts", default="fwd,bwd")
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
    ref_o, ref_lse = A.attention_fwd(q, k, v, cu, cu, L, L, True, scale, "tma")
    qb, kb, vb = (t.view(B, L, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)

    def bwd(variant):
        return A.attention_bwd(do, q, k, v, ref_o, ref_lse, cu, cu, L, L, True, scale, variant)

    if "bwd" in parts:  # the merged backward's outputs (the reference) and cuDNN's graph to differentiate
        base = torch.cat([t.float().flatten() for t in bwd("tma_merged")])
        qg, kg, vg = (t.detach().requires_grad_() for t in (qb, kb, vb))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        dout = do.view(B, L, HQ, D).transpose(1, 2).contiguous()

    def cudnn_bwd():
        return torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)

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
                  lambda: A.attention_fwd(q, k, v, cu, cu, L, L, True, scale, "tma"), flops)
            for cfg in g.CONFIGS[D]:
                g.FORCE_CONFIG["fwd"] = cfg
                fn = lambda: A.attention_fwd(q, k, v, cu, cu, L, L, True, scale, "gluon")  # noqa: E731
                o, lse = fn()
                err = max((o.float() - ref_o.float()).abs().max().item(), (lse - ref_lse).abs().max().item())
                timed(rnd, "fwd", candidate(cfg), fn, flops, max_diff_vs_tma=err)
            g.FORCE_CONFIG.clear()
        if "bwd" in parts:  # the whole backward (delta, kernels, casts) beside the merged Triton one and cuDNN's
            timed(rnd, "bwd", "triton tma_merged", lambda: bwd("tma_merged"), 2.5 * flops)
            timed(rnd, "bwd", "sdpa cudnn", cudnn_bwd, 2.5 * flops)
            for cfg in g.BWD_CONFIGS[D]:
                g.FORCE_CONFIG["bwd"] = cfg
                got = torch.cat([t.float().flatten() for t in bwd("gluon")])
                timed(rnd, "bwd", candidate(cfg), lambda: bwd("gluon"), 2.5 * flops,
                      max_diff_vs_tma=(got - base).abs().max().item())
            g.FORCE_CONFIG.clear()
    print_table(records, ["round", "kernel", "impl", "ms", "tflops", "max_diff_vs_tma"])
    print(f"results: {append_jsonl('attention_gluon', records)}")


if __name__ == "__main__":
    main()
