"""The speculative verify step's cost (areno.engine.speculative.verify_draft) next to plain sampling of the same rows.

    python bench/spec_verify.py
    python bench/spec_verify.py --batch 1 64 256 --k 1 2 4
    python bench/spec_verify.py --smoke   (a CPU run of the script at tiny shapes)

Per (batch B, draft length K): verify_draft of B sequences over K + 1 positions (fp32 logits [B, K+1, V], a draft
distribution [B, K, V]) at temperature 1, with top-k 50 / top-p 0.9, and with penalties (repetition, presence,
frequency on every row), against areno's fused ``sample`` of the same B x (K+1) rows, which is what the verify step
replaces. ``overhead_ms`` is the difference: the price of exactness that a speculative step pays on top of the
target's forward pass (it must stay small against the forward pass's time saved).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402


def _penalties(B, V, dev):
    """An adjust dict as the engine's adjust_host makes it, every row penalised, and its token state."""
    state = torch.randint(0, 3, (B, V), device=dev, dtype=torch.int32) * (torch.rand(B, V, device=dev) < 0.01)
    return {"min_p": torch.zeros(B, device=dev), "min_left": torch.zeros(B, dtype=torch.int32, device=dev),
            "sp_ids": torch.empty(B, 0, dtype=torch.int64, device=dev),
            "sp_bias": torch.empty(B, 0, device=dev), "sp_ban": torch.empty(B, 0, dtype=torch.bool, device=dev),
            "pen_slot": torch.arange(B, device=dev), "rep": torch.full((B,), 1.1, device=dev),
            "pres": torch.full((B,), 0.2, device=dev), "freq": torch.full((B,), 0.1, device=dev)}, state  # fmt: skip


def bench(B, K, V, iters, dev):
    from areno.engine.speculative import verify_draft
    from areno.kernels.sampler import sample

    torch.manual_seed(0)
    logits = torch.randn(B, K + 1, V, device=dev) * 3
    q = torch.softmax(torch.randn(B, K, V, device=dev) * 3, -1)
    draft = torch.multinomial(q.view(-1, V), 1).view(B, K)
    seeds = torch.arange(B, device=dev, dtype=torch.int64)
    offsets = torch.full((B,), 100, device=dev, dtype=torch.int64)
    flat = logits.view(-1, V)
    rows = []
    for name, filt in (("T=1", {}), ("top-k 50 top-p 0.9", {"top_k": 50, "top_p": 0.9}), ("penalties", None)):
        kw = dict(filt or {})
        if filt is None:
            adjust, state = _penalties(B, V, dev)
            kw.update(adjust=adjust, token_state=state)
        plain = {k: v for k, v in kw.items() if k in ("top_k", "top_p")}
        ms_verify = gpu_time_ms(partial(verify_draft, logits, draft, q, K, temperature=1.0, seeds=seeds,
                                        offsets=offsets, **kw), iters=iters)  # fmt: skip
        ms_plain = gpu_time_ms(partial(sample, flat, temperature=1.0, seeds=seeds.repeat_interleave(K + 1),
                                       offsets=offsets.repeat_interleave(K + 1), **plain), iters=iters)  # fmt: skip
        rows.append({"workload": name, "B": B, "K": K, "V": V, "verify_ms": ms_verify, "plain_sample_ms": ms_plain,
                     "overhead_ms": ms_verify - ms_plain})  # fmt: skip
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="a CPU run at tiny shapes (checks the script)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.batch, args.k, args.vocab, args.iters = [2], [2], 64, 2
    elif not torch.cuda.is_available():
        sys.exit("bench/spec_verify.py needs a CUDA GPU (or --smoke for a CPU run of the script)")
    env = env_info()
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  sha {env['git_sha']}", flush=True)
    rows = [r for B in args.batch for K in args.k for r in bench(B, K, args.vocab, args.iters, device)]
    print_table(rows, ["workload", "B", "K", "V", "verify_ms", "plain_sample_ms", "overhead_ms"])
    if not args.smoke:
        print(f"results appended to {append_jsonl('spec_verify', rows, env)}")


if __name__ == "__main__":
    main()
