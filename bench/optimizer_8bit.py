"""8-bit AdamW states (``--optimizer-states 8bit``) against fp32 states, same run: optimizer state memory and the
eager ``MasterAdamW.step()`` time over the Qwen3-0.6B parameter list (226 bf16 tensors, 596M elements), and the
loss curve of a short SFT run of a small model both ways.

    python bench/optimizer_8bit.py           # H200
    python bench/optimizer_8bit.py --smoke   # CPU: a tiny list and a few steps, checks the script
    python bench/optimizer_8bit.py --parts kernel --tiles 8x8,4x16,2x8,1x4   # the 8-bit kernel's tile, alone

Rows: ``part=memory``: ``state_gib`` (``MasterAdamW.state_bytes()``: fp32 master + moments), ``moments_gib``
(without the master) and the CUDA allocation the optimizer's construction added (``alloc_gib``); ``vs_fp32`` is
the 8-bit run's ``moments_gib`` over fp32's (the acceptance bar: <= 0.3) and ``state_vs_fp32`` the same with the
master. ``part=step``: median ms of one eager step (gradient flatten, norm, update, parameters written), ``path``
bucketed (a bucket at a time) or fused (one rank: areno.training.optimizer_fused, the default).
``part=kernel`` (``--tiles ROWSxWARPS,...``): the 8-bit kernel alone (``adamw8bit_``) over one flat tensor of as
many elements, per tile of ``adamw8bit.TILE`` (absmax blocks a program, warps), its median ms and the bytes it
moves (14 an element: the fp32 master read and written, the bf16 gradient read, both moments' codes read and
written) as GB/s and the fraction of the card's memory bandwidth (``hbm_frac``, areno.platform.roofline's); the step
rows use the module's tile (their ``tile``).
``part=loss``: ``--steps`` (200) next-token steps of a tiny Qwen3 (``areno.testing.make_tiny_checkpoint``) on 64
fixed random batches at lr 1e-3: the mean loss of the last 20 steps per run and the largest per-step difference
from fp32 seed 0; ``noise`` is fp32's spread between two data seeds (the 8-bit curve is within noise when its
difference is of that order).
One JSON line per measurement goes to bench/results/optimizer_8bit.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, gpu_time_ms, print_table, tiles  # noqa: E402
from optimizer_step import shapes  # noqa: E402

from areno.kernels import adamw8bit  # noqa: E402
from areno.platform.roofline import roofline_of  # noqa: E402
from areno.training.optimizer import MasterAdamW  # noqa: E402

GIB = 2**30
DEFAULT_TILES = "8x8,4x16,4x8,2x8,2x4,1x4,1x2,1x1"  # --tiles: the kernel part's sweep


def memory_and_step(smoke: bool, dev: torch.device) -> list[dict]:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g, device=dev) * 0.02).to(dtype)) for s in shapes(smoke)]
    grads = [(torch.randn(p.shape, generator=g, device=dev) * 1e-3).to(dtype) for p in params]
    n = sum(p.numel() for p in params)
    rows = []
    for states in ("fp32", "8bit"):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        opt = MasterAdamW(params, lr=1e-6, states=states)
        alloc = (torch.cuda.memory_allocated(dev) - before) if dev.type == "cuda" else 0
        master = 4 * n if dtype != torch.float32 else 0
        rows.append(dict(part="memory", states=states, elements=n, state_gib=opt.state_bytes() / GIB,
                         moments_gib=(opt.state_bytes() - master) / GIB, alloc_gib=alloc / GIB))

        def step(opt=opt):
            for p, gr in zip(params, grads):
                p.grad = gr
            opt.step(lr=1e-6, grad_clip=1.0)

        for fused in (False, True):  # the bucketed step, then many buckets a launch (training/optimizer_fused.py)
            opt.fused = fused
            tile = f"{adamw8bit.TILE['rows']}x{adamw8bit.TILE['num_warps']}" if states == "8bit" else None
            rows.append(dict(part="step", states=states, path="fused" if fused else "bucketed", tile=tile, elements=n,
                             ms=gpu_time_ms(step, warmup=2, iters=3 if smoke else 20)))
        del opt
    fp32 = {r["part"]: r for r in rows if r["states"] == "fp32"}
    for r in rows:
        if r["states"] == "8bit" and r["part"] == "memory":
            r["vs_fp32"] = r["moments_gib"] / fp32["memory"]["moments_gib"]
            r["state_vs_fp32"] = r["state_gib"] / fp32["memory"]["state_gib"]
    return rows


def kernel_rows(tiles: list[tuple[int, int]], smoke: bool, dev: torch.device) -> list[dict]:
    """The 8-bit kernel alone over the step's element count, one row per (rows, warps) tile."""
    n = sum(torch.Size(s).numel() for s in shapes(smoke))
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(n, generator=g, device=dev) * 0.02
    grad = (torch.randn(n, generator=g, device=dev) * 1e-3).to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    moments = adamw8bit.Moments8bit(n, dev)
    hp = dict(lr=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    roof = roofline_of(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    default, rows = dict(adamw8bit.TILE), []
    try:
        for tile_rows, warps in tiles:
            adamw8bit.TILE.update(rows=tile_rows, num_warps=warps)
            steps = iter(range(1, 10**6))
            ms = gpu_time_ms(lambda steps=steps: moments.step_(w, grad, step=next(steps), **hp), warmup=3,
                             iters=3 if smoke else 20)  # fmt: skip
            gbs = 14 * n / ms / 1e6
            rows.append(dict(part="kernel", states="8bit", tile=f"{tile_rows}x{warps}", elements=n, ms=ms,
                             gb_s=round(gbs, 1), hbm_frac=round(gbs * 1e9 / roof.bytes_per_s, 3) if roof else None,
                             default=(tile_rows, warps) == (default["rows"], default["num_warps"])))
    finally:
        adamw8bit.TILE.update(default)
    return rows


def loss_curve(states: str, seed: int, steps: int, dev: torch.device) -> list[float]:
    from areno.models import load_model
    from areno.testing import make_tiny_checkpoint

    root = os.path.join(os.environ.get("ARENO_BENCH_CACHE", os.path.expanduser("~/.cache/areno-bench")), "o8-tiny")
    if not os.path.exists(os.path.join(root, "config.json")):
        make_tiny_checkpoint(root, "qwen3", seed=0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = load_model(root, dtype=dtype, device=dev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = MasterAdamW(params, lr=1e-3, states=states)
    g = torch.Generator().manual_seed(seed)
    vocab = model.logits(torch.zeros(1, 1, dtype=torch.long, device=dev)).shape[-1]
    data = torch.randint(0, min(vocab, 64), (64, 8, 33), generator=g)  # a small fixed set the model can memorise
    losses = []
    for i in range(steps):
        ids = data[i % 64].to(dev)
        logits = model.logits(ids[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step(lr=1e-3, grad_clip=1.0)
        losses.append(float(loss.detach()))
    return losses


def loss_rows(steps: int, dev: torch.device) -> list[dict]:
    curves = {(s, seed): loss_curve(s, seed, steps, dev) for s, seed in (("fp32", 0), ("fp32", 1), ("8bit", 0))}
    tail = lambda c: sum(c[-20:]) / len(c[-20:])  # noqa: E731
    noise = abs(tail(curves["fp32", 0]) - tail(curves["fp32", 1]))
    rows = []
    for (states, seed), c in curves.items():
        diff = max(abs(a - b) for a, b in zip(c, curves["fp32", 0]))
        rows.append(dict(part="loss", states=states, seed=seed, steps=steps, first_loss=c[0], final_loss=tail(c),
                         max_step_diff_vs_fp32=diff, noise=noise))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny parameter list and few steps (checks the script)")
    ap.add_argument("--steps", type=int, default=200, help="SFT steps of each loss curve (--smoke: 10)")
    ap.add_argument("--parts", default="memory,step,loss", help="comma-separated: memory,step (one pass), kernel, loss")
    ap.add_argument("--tiles", type=tiles, default=None, help="part kernel: the 8-bit kernel's tiles, ROWSxWARPS "
                    f"(absmax blocks a program x warps; default {DEFAULT_TILES})")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/optimizer_8bit.jsonl")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"memory", "step", "kernel", "loss"}:
        ap.error(f"--parts: unknown {sorted(parts - {'memory', 'step', 'kernel', 'loss'})}")
    if args.tiles is not None and "kernel" not in parts:
        ap.error("--tiles: the kernel part's tiles; add kernel to --parts")
    on_gpu = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if on_gpu else "cpu")
    sweep = args.tiles or tiles(DEFAULT_TILES)
    rows = kernel_rows(sweep, args.smoke, dev) if "kernel" in parts else []  # (the module's tile put back after)
    rows += memory_and_step(args.smoke, dev) if parts & {"memory", "step"} else []
    rows += loss_rows(10 if args.smoke else args.steps, dev) if "loss" in parts else []
    print_table(rows, ["part", "states", "path", "tile", "seed", "elements", "state_gib", "moments_gib", "alloc_gib",
                       "vs_fp32", "state_vs_fp32", "ms", "gb_s", "hbm_frac", "first_loss", "final_loss",
                       "max_step_diff_vs_fp32", "noise"])
    if not args.no_save and not args.smoke:
        print("results:", append_jsonl("optimizer_8bit", rows))


if __name__ == "__main__":
    main()
