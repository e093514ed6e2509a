"""T1/T2 full training step with the optimizer: areno's trainer vs transformers + ``torch.optim.AdamW`` (sdpa).

    python bench/train_step.py          # H200: Qwen3-0.6B shape, random bf16 weights, 8x1024 and 4x4096 tokens
    python bench/train_step.py --smoke  # CPU: a tiny shape, checks the script (times meaningless)

One step = forward + backward + optimizer update of every parameter, next-token loss over the whole batch:
- areno: ``PolicyTrainer.train(rows, sft_loss_fn(), mini_bs=batch, gradient_accumulation_steps=1)`` with
  ``MasterAdamW`` (bf16 weights, fp32 master copy + fp32 AdamW state, grad clipping at 1.0) and a constant
  ``LRSchedule``; each row is ``Row(prompt_ids=[tok_0], response_ids=tok_1..)``, so every next token is a target,
  as in transformers' shifted loss. The step includes packing the rows (host side), the packed forward,
  ``linear_logprobs`` (no ``[tokens, vocab]`` logits), backward and the update. Activation checkpointing off and on.
- transformers: ``model(input_ids, labels=input_ids).loss.backward(); opt.step(); opt.zero_grad()`` with
  ``torch.optim.AdamW(lr=1e-6)`` on the bf16 parameters (bf16 optimizer state, no master copy), sdpa attention,
  exactly as ``../shared/baselines/hf_baseline.py`` measured it (46.5k tok/s at T1, 35.0 GiB peak); checkpointing
  through ``gradient_checkpointing_enable`` (non-reentrant) for the "on" rows.

MFU = 6 x 596,049,920 x tokens / step time / 790 TFLOP/s (BENCH.md; attention FLOPs and recomputation not counted).
Peak memory: ``torch.cuda.max_memory_allocated`` over a step with only that implementation's model, gradients,
optimizer state and activations resident (the optimizer state exists from the warm-up steps on).
One JSON line per measurement goes to bench/results/train_step.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402

WORKLOADS = {"T1": (8, 1024), "T2": (4, 4096)}
SMOKE_WORKLOADS = {"T1": (2, 64), "T2": (1, 128)}


def areno_setup(path, device):
    from areno.models import load_model
    from areno.rl.optimizer import MasterAdamW
    from areno.rl.schedule import LRSchedule
    from areno.rl.trainer import PolicyTrainer

    model = load_model(path, device=device).train()
    opt = MasterAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    return model, PolicyTrainer(model, opt, LRSchedule(1e-6), grad_clip=1.0)


def areno_step(state, ids, ckpt):
    from areno.rl.algorithms import sft_loss_fn
    from areno.rl.batch import Row

    model, trainer = state
    model.set_activation_checkpointing(ckpt)
    rows = [Row(prompt_ids=r[:1], response_ids=r[1:]) for r in ids.tolist()]
    loss_fn = sft_loss_fn()
    batch = len(rows)
    return lambda: trainer.train(rows, loss_fn, mini_bs=batch, gradient_accumulation_steps=1)


def hf_setup(path, device, smoke):
    import transformers

    dtype = torch.float32 if smoke else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6)


def hf_step(state, ids, ckpt):
    model, opt = state
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    ids = ids.to(next(model.parameters()).device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(impl, state, name, batch, seqlen, ckpt, device, args, vocab, n_params):
    rec = dict(impl=impl, workload=name, batch=batch, seqlen=seqlen, tokens=batch * seqlen, checkpointing=ckpt)
    try:
        ids = torch.randint(models.FIRST_TOKEN, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(0))
        step = (areno_step if impl == "areno" else hf_step)(state, ids, ckpt)
        warmup, iters = (args.warmup, args.iters) if impl == "areno" else (args.hf_warmup, args.hf_iters)
        ms = gpu_time_ms(step, warmup=warmup, iters=iters)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rec.update(step_ms=ms, tok_s=batch * seqlen / (ms / 1e3))
        rec["mfu"] = 6 * n_params * batch * seqlen / (ms / 1e3) / models.PEAK_FLOPS
    except Exception as e:  # OOM or a failing implementation: report it and go on
        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on any device (checks the script)")
    ap.add_argument("--workloads", default="T1,T2")
    ap.add_argument("--impls", default="areno,transformers")
    ap.add_argument("--checkpointing", default="off,on", help="off, on or off,on")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--hf-warmup", type=int, default=2)
    ap.add_argument("--hf-iters", type=int, default=5)
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/train_step.jsonl")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = models.shape_of(args.smoke)
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    if args.smoke:
        args.warmup, args.iters, args.hf_warmup, args.hf_iters = 1, 2, 1, 2
    n_params = models.num_params(shape)
    t_start = time.perf_counter()
    path = models.checkpoint(args.smoke)
    print(f"checkpoint {path} ({time.perf_counter() - t_start:.1f}s), {n_params:,} parameters", flush=True)

    records = []
    for impl in args.impls.split(","):
        t0 = time.perf_counter()
        try:
            state = areno_setup(path, device) if impl == "areno" else hf_setup(path, device, args.smoke)
        except Exception as e:
            traceback.print_exc()
            records.append(dict(impl=impl, error=f"setup: {type(e).__name__}: {e}"[:300]))
            continue
        for name in args.workloads.split(","):
            batch, seqlen = workloads[name]
            for ckpt in args.checkpointing.split(","):
                records.append(
                    measure(impl, state, name, batch, seqlen, ckpt == "on", device, args, shape["vocab_size"], n_params)
                )
        if impl == "areno":
            state[1].optimizer.close()
        del state
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{impl} done in {time.perf_counter() - t0:.1f}s", flush=True)

    base = {(r["workload"], r["checkpointing"]): r for r in records if r["impl"] == "transformers" and "step_ms" in r}
    hf_off = {r["workload"]: r for r in base.values() if not r["checkpointing"]}
    for r in records:
        if r["impl"] != "areno" or "step_ms" not in r:
            continue
        ref = base.get((r["workload"], r["checkpointing"]))
        if ref is not None:
            r["speedup_vs_hf"] = ref["step_ms"] / r["step_ms"]
        ref = hf_off.get(r["workload"])  # memory against the baseline as BENCH.md measured it (no checkpointing)
        if ref is not None and "peak_gib" in r and "peak_gib" in ref:
            r["memory_vs_hf"] = r["peak_gib"] / ref["peak_gib"]
    cols = ["impl", "workload", "checkpointing", "step_ms", "tok_s", "mfu", "peak_gib", "speedup_vs_hf",
            "memory_vs_hf", "error"]  # fmt: skip
    print_table(records, cols)
    for r in records:
        if r["impl"] == "areno" and not r["checkpointing"] and "speedup_vs_hf" in r:
            ok = r["speedup_vs_hf"] >= 1.5 and r.get("memory_vs_hf", 0) <= 0.7
            print(f"{r['workload']} bar (>= 1.5x transformers, <= 0.7x its memory): {'PASS' if ok else 'FAIL'} "
                  f"({r['speedup_vs_hf']:.2f}x, {r.get('memory_vs_hf', float('nan')):.2f}x memory, MFU {r['mfu']:.1%}; "
                  f"goal 50% MFU, <= 0.5x memory)")  # fmt: skip
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = "qwen3-0.6b"
        print("results:", append_jsonl("train_step", records, env))


if __name__ == "__main__":
    main()
