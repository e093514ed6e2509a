"""MLA decode attention: the absorbed form over the latent cache vs ``paged_attention`` over K/V expanded per head.

    python bench/mla_decode.py                             # H200: Ling 3 widths, bf16 (about a minute)
    python bench/mla_decode.py --sweep                     # also every tile config of the latent kernel
    TRITON_INTERPRET=1 python bench/mla_decode.py --smoke  # CPU: tiny shapes, checks the script (times meaningless)

One MLA layer's decode attention at Ling-3.0-Flash's widths (H = 32 heads, kv_lora_rank R = 512, d_rope P = 64,
d_nope = d_v = 128), B sequences of context L each, block 16, blocks scattered at random:
- latent: ``q_lat = q_nope W_uk`` (bmm), ``mla_decode`` over rows ``[c | k_rope]`` (R + P = 576 values a token),
  then ``o = W_uv o_lat`` (bmm); the part the expanded path does not do (absorption, up-projection) is timed in;
- expanded: ``paged_attention`` over K and V ``[32 heads, 192]`` (v zero-padded to 192, as the engine stores it).
Bytes (the bound; decode is bandwidth-bound): latent B * L * 576 * 2, expanded B * L * 2 * 32 * 192 * 2, plus q/o
and W_kvb (32 * 256 * 512 * 2) for the latent path. GB/s and the fraction of 4.3 TB/s beside each time; the
max |difference| of the two outputs (bf16) per shape. One JSON line per measurement: bench/results/mla_decode.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

os.environ.setdefault("ARENO_KERNELS", "triton")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402

from areno.kernels.attention.mla import mla_decode, mla_decode_triton  # noqa: E402
from areno.kernels.attention.paged import paged_attention  # noqa: E402

HBM = 4.3e12
SHAPES = [(1, 4096), (1, 32768), (32, 4096), (64, 8192), (256, 1024), (256, 4096)]
SMOKE_SHAPES = [(2, 40), (3, 17)]


def make(B, L, H, R, P, nope, dv, dtype, dev, page=16, seed=0):
    """Random inputs drawn on ``dev``; the expanded cache holds the same tokens: K = [W_uk c | k_rope], V = W_uv c
    zero-padded to K's width."""
    g = torch.Generator(device=dev).manual_seed(seed)
    need = -(-L // page)
    blocks = B * need
    table = torch.randperm(blocks, generator=g, device=dev).view(B, need).to(torch.int32)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    rows = torch.randn(blocks, page, R + P, generator=g, device=dev).to(dtype)
    w = (torch.randn(H, nope + dv, R, generator=g, device=dev) * R**-0.5).to(dtype)
    q = torch.randn(B, H, nope + P, generator=g, device=dev).to(dtype)
    width = max(nope + P, dv)
    k = torch.cat([torch.einsum("bsr,hnr->bshn", rows[..., :R], w[:, :nope]),
                   rows[..., R:].unsqueeze(2).expand(-1, -1, H, -1)], dim=-1)
    v = torch.nn.functional.pad(torch.einsum("bsr,hvr->bshv", rows[..., :R], w[:, nope:]), (0, width - dv))
    return dict(rows=rows, w=w, q=q, k=k, v=v, table=table, lens=lens, width=width)


def latent_fn(t, R, nope, scale, config=None):
    q, w = t["q"], t["w"]

    def fn():
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)
        qa = torch.cat([q_lat, q[..., nope:]], dim=-1)
        if config is None:
            o_lat = mla_decode(qa, t["rows"], t["table"], t["lens"], kv_lora_rank=R, softmax_scale=scale)
        else:
            o_lat = mla_decode_triton(qa, t["rows"], t["table"], t["lens"], R, scale, config=config)
        return torch.bmm(o_lat.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)

    return fn


def expanded_fn(t, nope, P, dv, scale):
    q = torch.nn.functional.pad(t["q"], (0, t["width"] - nope - P))

    def fn():
        return paged_attention(q, t["k"], t["v"], t["table"], t["lens"], softmax_scale=scale)[..., :dv]

    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time every (BLOCK_H, BLOCK_N, warps, stages) of the kernel")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        H, R, P, nope, dv, dtype, shapes = 4, 32, 16, 16, 16, torch.float32, SMOKE_SHAPES
    else:
        H, R, P, nope, dv, dtype, shapes = 32, 512, 64, 128, 128, torch.bfloat16, SHAPES
    scale = (nope + P) ** -0.5
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for B, L in shapes:
        t = make(B, L, H, R, P, nope, dv, dtype, dev)
        lat, exp = latent_fn(t, R, nope, scale), expanded_fn(t, nope, P, dv, scale)
        diff = (lat().float() - exp().float()).abs().max().item()
        weights = H * (nope + dv) * R * elem
        for name, fn, nbytes in (("latent", lat, B * L * (R + P) * elem + weights),
                                 ("expanded", exp, B * L * 2 * H * t["width"] * elem)):
            ms = gpu_time_ms(fn, warmup=2 if args.smoke else 10, iters=3 if args.smoke else 50)
            rows.append(dict(impl=name, B=B, L=L, ms=ms, gb_s=nbytes / ms / 1e6, frac_hbm=nbytes / ms / 1e-3 / HBM,
                             cache_mb=nbytes / 1e6, max_diff=diff))
        exp_ms = rows[-1]["ms"]
        rows[-2]["speedup_vs_expanded"] = exp_ms / rows[-2]["ms"]
        if args.sweep:
            grid = [(16, 32, 4, 2)] if args.smoke else itertools.product((16, 32), (16, 32, 64), (4, 8), (1, 2, 3))
            for cfg in grid:
                try:
                    ms = gpu_time_ms(latent_fn(t, R, nope, scale, cfg), warmup=2, iters=3 if args.smoke else 30)
                    rows.append(dict(impl=f"latent{cfg}", B=B, L=L, ms=ms, speedup_vs_expanded=exp_ms / ms))
                except Exception as e:  # e.g. out of shared memory: reported, the sweep goes on
                    rows.append(dict(impl=f"latent{cfg}", B=B, L=L, error=f"{type(e).__name__}"))
        del t
    print_table(rows, ["impl", "B", "L", "ms", "gb_s", "frac_hbm", "cache_mb", "speedup_vs_expanded", "max_diff",
                       "error"])
    if not args.no_save and not args.smoke:
        print("results:", append_jsonl("mla_decode", rows, env_info()))


if __name__ == "__main__":
    main()
