"""One decode step's sampling at batch 256 x vocab 151,936: areno's fused sampler vs torch softmax + multinomial.

    python bench/sampler.py
    python bench/sampler.py --batch 1 64 256

Rows: from logits (fp32 and bf16), plain temperature sampling and with top-k 50 / top-p 0.9 on every row (torch:
sort-based filter as the usual engines do it), and from hidden (1024) + LM head, where the matmul is included on
both sides. areno also runs replayed from a CUDA graph (how decode uses it) next to eager. Every row returns the
token and its logprob. GB/s counts one read of the logits (B x V x element size) over the time; the H200 copy
ceiling is ~4.3 TB/s read + write, so ~3 TB/s is a fair read-only ceiling guess.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import append_jsonl, env_info, gpu_time_ms, graph_replay, print_table  # noqa: E402


def torch_sample(logits, temp, top_k=None, top_p=None):
    z = logits.float() / temp[:, None]
    logp_full = z.log_softmax(-1)
    if top_k is not None:  # sort-based top-k then top-p (Hugging Face order), as engines without fused kernels do
        sorted_z, order = z.sort(dim=-1, descending=True)
        ranks = torch.arange(z.shape[1], device=z.device)[None, :]
        sorted_z = sorted_z.masked_fill(ranks >= top_k[:, None], float("-inf"))
        cum = sorted_z.softmax(-1).cumsum(-1)
        sorted_z = sorted_z.masked_fill((cum - sorted_z.softmax(-1)) >= top_p[:, None], float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(1, order, sorted_z)
    probs = z.softmax(-1)
    tokens = torch.multinomial(probs, 1)[:, 0]
    return tokens, logp_full.gather(1, tokens[:, None])[:, 0]


def _graphed(fn):
    """Capture fn() once; return a callable that replays it (None if capture fails)."""
    try:
        return graph_replay(fn)
    except Exception as e:
        print(f"note: CUDA graph capture failed: {type(e).__name__}: {e}", flush=True)
        return None


def bench(B, V, H, iters, dev="cuda"):
    from areno.kernels.sampler import sample

    torch.manual_seed(0)
    wdt = torch.bfloat16 if dev == "cuda" else torch.float32
    hidden = torch.randn(B, H, device=dev, dtype=wdt)
    weight = torch.randn(V, H, device=dev, dtype=wdt) * 0.05
    logits32 = (hidden.float() @ weight.float().T).contiguous()
    logits16 = logits32.to(torch.bfloat16)
    temp = torch.full((B,), 1.0, device=dev)
    top_k = torch.full((B,), 50, device=dev, dtype=torch.int64)
    top_p = torch.full((B,), 0.9, device=dev)
    k_off = torch.zeros(B, device=dev, dtype=torch.int64)
    p_off = torch.ones(B, device=dev)
    seeds = torch.arange(B, device=dev, dtype=torch.int64)
    offsets = torch.zeros(B, device=dev, dtype=torch.int64)
    cases = []
    for name, x in (("fp32", logits32), ("bf16", logits16)):
        nbytes = x.numel() * x.element_size()
        cases += [
            (f"logits {name}", "torch", lambda x=x: torch_sample(x, temp), nbytes),
            (f"logits {name}", "areno", lambda x=x: sample(x, temperature=temp, seeds=seeds, offsets=offsets), nbytes),
            (f"logits {name}", "areno (filters off)",
             lambda x=x: sample(x, temperature=temp, top_k=k_off, top_p=p_off, seeds=seeds, offsets=offsets), nbytes),
            (f"logits {name} top-k 50 top-p 0.9", "torch", lambda x=x: torch_sample(x, temp, top_k, top_p), nbytes),
            (f"logits {name} top-k 50 top-p 0.9", "areno",
             lambda x=x: sample(x, temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds, offsets=offsets), nbytes),
        ]  # fmt: skip
    wbytes = weight.numel() * weight.element_size()
    cases += [
        (f"hidden {H} + LM head", "torch", lambda: torch_sample(hidden @ weight.T, temp), wbytes),
        (f"hidden {H} + LM head", "areno",
         lambda: sample(hidden=hidden, weight=weight, temperature=temp, seeds=seeds, offsets=offsets), wbytes),
    ]  # fmt: skip
    rows = []
    for workload, impl, fn, nbytes in cases:
        for mode in ("eager", "graph") if dev == "cuda" else ("eager",):
            try:
                run = fn if mode == "eager" else _graphed(fn)
                if run is None:
                    continue
                ms = gpu_time_ms(run, warmup=5, iters=iters)
            except Exception as e:
                print(f"{workload} / {impl} / {mode}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append({"workload": workload, "impl": impl, "mode": mode, "B": B, "V": V, "ms": ms,
                         "GB/s": nbytes / ms / 1e6})  # fmt: skip
    for r in rows:
        base = [b for b in rows if b["workload"] == r["workload"] and b["impl"] == "torch" and b["mode"] == "eager"]
        if base:
            r["speedup_vs_torch_eager"] = base[0]["ms"] / r["ms"]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script at tiny shapes")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/sampler.py needs a CUDA GPU (or --device cpu for a smoke run)")
    env = env_info()
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  sha {env['git_sha']}", flush=True)
    rows = []
    for B in args.batch:
        rows += bench(B, args.vocab, args.hidden, args.iters, args.device)
    print_table(rows, ["workload", "impl", "mode", "B", "ms", "GB/s", "speedup_vs_torch_eager"])
    print(f"results appended to {append_jsonl('sampler', rows, env)}")


if __name__ == "__main__":
    main()
