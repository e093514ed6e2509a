"""The optimizer step of the graphed trainer: ``MasterAdamW.device_norm`` + ``device_update`` over the Qwen3-0.6B
parameter list (226 bf16 tensors, 596M elements), multi-tensor launches vs one launch per parameter.

    python bench/optimizer_step.py           # H200: eager and CUDA-graphed, both ways, same run
    python bench/optimizer_step.py --smoke   # CPU: a tiny list, checks the script (times meaningless)

``multi``: what ``MasterAdamW`` runs (``areno.kernels.adamw``): the gradient's sum of squares in one launch
(``grad_sumsq``) and master AdamW in one launch per learning-rate group (``master_adamw_multi_``), from pointer
tables built ahead (``device_plan``). ``per_tensor``: the previous way, in the same process: ``torch._foreach_norm``
then ``master_adamw_`` once per parameter. Bytes moved by the update: 28 per element (bf16 gradient in, fp32 master
and moments read and written, bf16 parameter out); the norm reads the 2-byte gradient once.
One JSON line per measurement goes to bench/results/optimizer_step.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, gpu_time_ms, graph_replay, print_table  # noqa: E402

from areno.kernels import adamw  # noqa: E402
from areno.training.optimizer import MasterAdamW  # noqa: E402

LAYER = [(6144, 1024), (1024, 3072), (4096, 1024), (1024, 2048), (1024,), (1024,), (128,), (128,)]  # Qwen3-0.6B


def shapes(smoke: bool) -> list[tuple]:
    if smoke:
        return [(1000, 64)] + [(96, 64), (64, 96), (64,), (16,)] * 2 + [(64,)]
    return [(151936, 1024)] + LAYER * 28 + [(1024,)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny parameter list on any device (checks the script)")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/optimizer_step.jsonl")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    params = [torch.nn.Parameter((torch.randn(s, generator=g, device=dev) * 0.02).to(dtype))
              for s in shapes(args.smoke)]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g, device=dev) * 1e-3).to(dtype)
    n = sum(p.numel() for p in params)
    opt = MasterAdamW(params, lr=1e-6)
    plan = opt.device_plan()
    lr, step, skip = (torch.zeros((), device=dev) for _ in range(3))
    lr.fill_(1e-6)
    entries = opt._master_entries().get(None, [])
    hp = dict(beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps, weight_decay=opt.weight_decay)

    def multi():
        _, bad, scale = opt.device_norm(1.0, skip=skip, plan=plan)
        opt.device_update(lr, step, bad, scale, plan=plan)

    def per_tensor():
        norm = torch.stack(torch._foreach_norm([p.grad for p in params], 2, dtype=torch.float32)).double()
        norm = norm.square().sum().sqrt()
        scale = ((norm + 1e-6) / 1.0).clamp(min=1.0).float()
        step.add_(1.0)
        corr = adamw.bias_corrections(lr, step, *opt.betas)
        for w, m, v, grad, p in entries:
            adamw.master_adamw_(w, m, v, grad, p, lr, *corr, scale, skip, **hp)

    def graphed(fn):
        return graph_replay(fn) if dev.type == "cuda" else fn

    def sumsq():
        adamw.grad_sumsq([p.grad for p in params], plan["norm"])

    rows = []
    for name, fn in [("per_tensor", per_tensor), ("multi", multi)]:
        for mode in ("eager", "graph"):
            ms = gpu_time_ms(graphed(fn) if mode == "graph" else fn, warmup=3, iters=5 if args.smoke else 30)
            rows.append(dict(impl=name, mode=mode, tensors=len(params), elements=n, ms=ms,
                             update_tb_s=28 * n / (ms / 1e3) / 1e12))
    rows.append(dict(impl="multi", mode="sumsq_only", tensors=len(params), elements=n,
                     ms=gpu_time_ms(sumsq, warmup=3, iters=5 if args.smoke else 30)))
    rows[-1]["norm_tb_s"] = params[0].element_size() * n / (rows[-1]["ms"] / 1e3) / 1e12
    base = {r["mode"]: r["ms"] for r in rows if r["impl"] == "per_tensor"}
    for r in rows:
        if r["impl"] == "multi" and r["mode"] in base:
            r["speedup_vs_per_tensor"] = base[r["mode"]] / r["ms"]
    print_table(rows, ["impl", "mode", "tensors", "elements", "ms", "update_tb_s", "norm_tb_s",
                       "speedup_vs_per_tensor"])
    if not args.no_save and not args.smoke:
        print("results:", append_jsonl("optimizer_step", rows))


if __name__ == "__main__":
    main()
