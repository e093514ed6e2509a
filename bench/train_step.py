"""T1/T2 full training step with the optimizer: areno's trainer vs transformers + ``torch.optim.AdamW`` (sdpa).

    python bench/train_step.py          # H200: Qwen3-0.6B shape, random bf16 weights, 8x1024 and 4x4096 tokens
    python bench/train_step.py --smoke  # CPU: a tiny shape, checks the script (times meaningless)
    python bench/train_step.py --impls areno --checkpointing off --graphs off,on   # the CUDA-graph A/B alone

One step = forward + backward + optimizer update of every parameter, next-token loss over the whole batch:
- areno: ``PolicyTrainer.train(rows, sft_loss_fn(), mini_bs=batch, gradient_accumulation_steps=1)`` with
  ``MasterAdamW`` (bf16 weights, fp32 master copy + fp32 AdamW state, grad clipping at 1.0) and a constant
  ``LRSchedule``; each row is ``Row(prompt_ids=[tok_0], response_ids=tok_1..)``, so every next token is a target,
  as in transformers' shifted loss. The step includes packing the rows (host side), the packed forward,
  ``linear_logprobs`` (no ``[tokens, vocab]`` logits), backward and the update. Activation checkpointing off and on.
  ``--graphs off,on`` measures the trainer with ``train_cuda_graphs="off"`` and ``"on"`` (areno.training.graphs:
  forward/backward and optimizer replayed as CUDA graphs; the first steps capture) in the same run; checkpointing
  "on" rows run eager only (recomputation is not graphed). The loss is linear in the log-probs, so the head takes
  its gradient in the forward (``linear_logprobs_loss``, one GEMM-equivalent fewer); ``--sft-head plain`` (or
  ``fused,plain``) also measures the same loss built on ``linear_logprobs``' output (gradient in the backward).
- transformers: ``model(input_ids, labels=input_ids).loss.backward(); opt.step(); opt.zero_grad()`` with
  ``torch.optim.AdamW(lr=1e-6)`` on the bf16 parameters (bf16 optimizer state, no master copy), sdpa attention,
  as ``bench/baselines/transformers_generate_train.py`` measures it (BENCH.md: 46.5k tok/s at T1, 35.0 GiB peak);
  checkpointing through ``gradient_checkpointing_enable`` (non-reentrant) for the "on" rows.

MFU = 6 x 596,049,920 x tokens / step time / 790 TFLOP/s (BENCH.md; attention FLOPs and recomputation not counted).
Two step times per row: ``step_ms``, the median of single steps each timed by CUDA events and waited for (the host's
work before a step's first kernel counts, with the GPU idle), and ``loop_ms``, the mean over ``--iters`` steps run
back to back with one synchronisation at the end, as ``bench/baselines/transformers_generate_train.py`` (the baseline)
times them: a step's host work may then overlap the previous step's GPU tail (``loop_mfu``, ``loop_speedup_vs_hf``);
``loop_ms`` is the median of the GPU's intervals between consecutive steps' start events, ``loop_mean_ms`` the mean
wall time.
Peak memory: ``torch.cuda.max_memory_allocated`` over a step with only that implementation's model, gradients,
optimizer state and activations resident (the optimizer state exists from the warm-up steps on). A graph replay
allocates nothing, so for graphs ``peak_gib`` misses the pool's activations: compare ``reserved_gib``
(``max_memory_reserved`` after emptying the allocator's cache), which counts the graph pool, between rows.
One JSON line per measurement goes to bench/results/train_step.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
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
    from areno.training.optimizer import MasterAdamW

    model = load_model(path, device=device).train()
    opt = MasterAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    return model, opt, {}


def areno_trainer(state, graphs):
    """The trainer of one graphs mode (made once, sharing the model and optimizer state)."""
    from areno.training.schedule import LRSchedule
    from areno.training.trainer import PolicyTrainer

    model, opt, trainers = state
    for mode, t in list(trainers.items()):  # only one mode's graph pool resident at a time
        if mode != graphs and t.graphs is not None:
            t.graphs.close()
            t.graphs = None
            del trainers[mode]
    if graphs not in trainers:
        trainers[graphs] = PolicyTrainer(model, opt, LRSchedule(1e-6), grad_clip=1.0, train_cuda_graphs=graphs)
    return trainers[graphs]


def areno_step(state, ids, ckpt, graphs="off", head="fused"):
    from areno.rl.algorithms import sft_loss_fn
    from areno.rl.losses import sft_loss
    from areno.training.batch import Row

    model = state[0]
    trainer = areno_trainer(state, graphs)
    model.set_activation_checkpointing(ckpt)
    rows = [Row(prompt_ids=r[:1], response_ids=r[1:]) for r in ids.tolist()]
    loss_fn = sft_loss_fn()
    if head == "plain":  # the same loss without token weights: the trainer runs linear_logprobs + its backward
        loss_fn = lambda out, packed, norms: sft_loss(out.logprobs, packed.mask, num_tokens=norms.num_tokens)  # noqa: E731
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


def measure(impl, state, name, batch, seqlen, ckpt, device, args, vocab, n_params, graphs=None, head=None):
    rec = dict(impl=impl, workload=name, batch=batch, seqlen=seqlen, tokens=batch * seqlen, checkpointing=ckpt)
    if graphs is not None:
        rec["graphs"] = graphs
    if head is not None:
        rec["head"] = head
    try:
        ids = torch.randint(models.FIRST_TOKEN, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(0))
        step = areno_step(state, ids, ckpt, graphs, head) if impl == "areno" else hf_step(state, ids, ckpt)
        warmup, iters = (args.warmup, args.iters) if impl == "areno" else (args.hf_warmup, args.hf_iters)
        ms = gpu_time_ms(step, warmup=warmup, iters=iters)
        if device.type == "cuda":  # back to back, one sync at the end (hf_baseline.py's timing)
            torch.cuda.synchronize()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
            t0 = time.perf_counter()
            for i in range(iters):
                marks[i].record()  # reached by the GPU when it starts this step's work (or ends the last one's)
                step()
            marks[-1].record()
            torch.cuda.synchronize()
            rec["loop_mean_ms"] = (time.perf_counter() - t0) / iters * 1e3
            rec["loop_ms"] = statistics.median(a.elapsed_time(b) for a, b in zip(marks, marks[1:]))
            rec["loop_mfu"] = 6 * n_params * batch * seqlen / (rec["loop_ms"] / 1e3) / models.PEAK_FLOPS
        if device.type == "cuda":
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            rec["reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if graphs == "on":
            g = areno_trainer(state, graphs).graphs
            rec["graph_replays"] = 0 if g is None else g.replays  # 0: the step ran eagerly
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
    ap.add_argument("--graphs", default="off,on", help="areno's --train-cuda-graphs modes to measure: off, on or "
                    "off,on (on: checkpointing-off rows only; recomputation is not graphed)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--hf-warmup", type=int, default=2)
    ap.add_argument("--hf-iters", type=int, default=5)
    ap.add_argument("--sft-head", default="fused", help="areno's head: fused (gradient in the forward), plain, or "
                    "fused,plain (both, same run)")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/train_step.jsonl")
    args = ap.parse_args()
    heads = args.sft_head.split(",")
    if not heads or any(h not in ("fused", "plain") for h in heads):
        ap.error(f"--sft-head: a comma list of fused, plain (got {args.sft_head!r})")
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
                modes = [None]  # transformers
                if impl == "areno":  # graphs only where they apply: a GPU, no recomputation
                    graphed = ckpt == "off" and device.type == "cuda"
                    modes = [g for g in args.graphs.split(",") if g == "off" or graphed]
                for graphs in modes:
                    for head in heads if impl == "areno" else [None]:
                        records.append(measure(impl, state, name, batch, seqlen, ckpt == "on", device, args,
                                               shape["vocab_size"], n_params, graphs, head))
        if impl == "areno":
            for t in state[2].values():
                if t.graphs is not None:
                    t.graphs.close()
            state[1].close()
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
            if "loop_ms" in r and "loop_ms" in ref:
                r["loop_speedup_vs_hf"] = ref["loop_ms"] / r["loop_ms"]
        ref = hf_off.get(r["workload"])  # memory against the baseline as BENCH.md measured it (no checkpointing)
        if ref is not None and "peak_gib" in r and "peak_gib" in ref:
            r["memory_vs_hf"] = r["peak_gib"] / ref["peak_gib"]
        if ref is not None and "reserved_gib" in r and "reserved_gib" in ref:
            r["reserved_vs_hf"] = r["reserved_gib"] / ref["reserved_gib"]
    eager = {(r["workload"], r["checkpointing"], r.get("head")): r for r in records
             if r["impl"] == "areno" and r.get("graphs") == "off" and "step_ms" in r}
    for r in records:
        ref = eager.get((r["workload"], r["checkpointing"], r.get("head")))
        if r["impl"] == "areno" and r.get("graphs") == "on" and "step_ms" in r and ref is not None:
            r["speedup_vs_eager"] = ref["step_ms"] / r["step_ms"]
            if "reserved_gib" in r and "reserved_gib" in ref:
                r["reserved_vs_eager"] = r["reserved_gib"] / ref["reserved_gib"]
    cols = ["impl", "workload", "checkpointing", "graphs", "head", "step_ms", "tok_s", "mfu", "loop_ms", "loop_mfu",
            "peak_gib", "reserved_gib", "speedup_vs_hf", "loop_speedup_vs_hf", "speedup_vs_eager", "memory_vs_hf",
            "reserved_vs_hf", "reserved_vs_eager", "error"]  # fmt: skip
    print_table(records, cols)
    for r in records:
        if r["impl"] == "areno" and not r["checkpointing"] and "speedup_vs_hf" in r:
            ok = r["speedup_vs_hf"] >= 1.8 and r["mfu"] >= 0.40
            loop = (f"; back to back {r['loop_speedup_vs_hf']:.2f}x, MFU {r['loop_mfu']:.1%}"
                    if "loop_speedup_vs_hf" in r else "")
            print(f"{r['workload']} graphs {r.get('graphs')} bar (>= 40% MFU, >= 1.8x transformers + AdamW, memory "
                  f"no more than eager's): {'PASS' if ok else 'FAIL'} ({r['speedup_vs_hf']:.2f}x, MFU {r['mfu']:.1%}"
                  f"{loop}, "
                  f"{r.get('memory_vs_hf', float('nan')):.2f}x allocated / "
                  f"{r.get('reserved_vs_hf', float('nan')):.2f}x reserved vs transformers; goal 50% MFU)")
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = "qwen3-0.6b"
        print("results:", append_jsonl("train_step", records, env))


if __name__ == "__main__":
    main()
