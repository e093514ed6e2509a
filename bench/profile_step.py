"""Kernel-level profile (torch.profiler) of one areno T1 train step and of decode steps at R1's shape.

    python bench/profile_step.py train     # T1: 8 x 1024 tokens, fwd + bwd + optimizer (Qwen3-0.6B shape)
    python bench/profile_step.py train --train-cuda-graphs on   # the same step replayed as CUDA graphs
    python bench/profile_step.py train --shape 4x4096              # T2's layout
    python bench/profile_step.py train --shape 4x4096 --train-cuda-graphs on --gaps   # where the GPU idles
    python bench/profile_step.py decode    # 256 sequences, 128-token prompts, CUDA-graph decode steps
    python bench/profile_step.py decode --eager
    python bench/profile_step.py train --family qwen3_5-35b-a3b --optimizer-states 8bit   # issue 38's T1, 8-bit AdamW
    python bench/profile_step.py decode --family qwen3_5-9b   # issue 38's shapes (bench/families.py), random weights
    python bench/profile_step.py decode --family qwen3_5-9b --state-dtype bfloat16 --decode-steps 8 --gaps
    python bench/profile_step.py decode --family 8b --rollout-dtype fp8   # FP8 rollout's step (bench/rollout.py's 8B)
    python bench/profile_step.py decode --speculative-tokens 2 --gaps   # R1 with MTP speculation gated (issue 41):
        # bench/spec.py's 9B-shaped Qwen3.5 with its MTP layer; without --speculative-tokens, --mtp the same model plain

Prints the top GPU kernels by total time and the step's wall time; a diagnostic, nothing is saved.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
import rollout  # noqa: E402


def table(prof, n=30):
    print(prof.key_averages().table(sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total",
                                    row_limit=n, max_name_column_width=70), flush=True)


def print_gaps(prof, n, min_us=20.0):
    """Where the GPU idles: its busy time against the span from the first to the last GPU activity, and for the
    ``n`` longest gaps (> ``min_us``) the innermost host frames (Python functions, ops) running at the gap's middle."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e)
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op", "user_annotation") and "dur" in e]
    if not gpu:
        cats = sorted({str(e.get("cat")) for e in events})
        print(f"no GPU activity in the trace (event categories: {', '.join(cats)})")
        return
    merged = [list(gpu[0])]
    for a, b in gpu[1:]:
        if a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    span = merged[-1][1] - merged[0][0]
    busy = sum(b - a for a, b in merged)
    gaps = [(b2 - a1, a1, b2) for (_, a1), (b2, _) in zip(merged, merged[1:]) if b2 - a1 > min_us]
    print(f"2 (scheduling) steps: GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, "
          f"idle {(span - busy) / 1e3:.1f} ms "
          f"({len(gaps)} gaps > {min_us:.0f} us: {sum(g[0] for g in gaps) / 1e3:.1f} ms)")
    for dur, a, b in sorted(gaps, reverse=True)[:n]:
        mid = (a + b) / 2
        frames = sorted((e for e in host if e["ts"] <= mid <= e["ts"] + e["dur"]), key=lambda e: e["dur"])
        names = " < ".join(e["name"][:60] for e in frames[:4]) or "(no host frame)"
        print(f"  {dur / 1e3:7.2f} ms at +{(a - merged[0][0]) / 1e3:7.1f} ms: {names}")


def families_model(name: str, part: str, smoke: bool, device):
    """A random-weight bench/families.py shape with that bench's layer count for ``part`` (rollout, train; 4 under
    ``smoke``): bf16 on a GPU, fp32 on the CPU."""
    import families

    layers = 4 if smoke else families.SHAPES[name][1 if part == "rollout" else 2]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return models.random_model(families.config_of(name, layers, smoke), dtype, device, unit_norms=True)


def train(args, device):
    from areno.models import load_model
    from areno.rl.algorithms import sft_loss_fn
    from areno.training.batch import Row
    from areno.training.optimizer import MasterAdamW
    from areno.training.schedule import LRSchedule
    from areno.training.trainer import PolicyTrainer

    if args.family:  # issue 38's T1: the family's train layers at full width (bench/families.py)
        model = families_model(args.family, "train", args.smoke, device).train()
    else:
        model = load_model(models.checkpoint(args.smoke), device=device).train()
    model.set_activation_checkpointing(False)
    opt = MasterAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, states=args.optimizer_states)
    trainer = PolicyTrainer(model, opt, LRSchedule(1e-6), grad_clip=1.0, train_cuda_graphs=args.train_cuda_graphs)
    b, s = (2, 64) if args.smoke else (args.rows, args.tokens)
    ids = torch.randint(models.FIRST_TOKEN, model.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    rows = [Row(prompt_ids=r[:1], response_ids=r[1:]) for r in ids.tolist()]

    def step():
        trainer.train(rows, sft_loss_fn(), mini_bs=b, gradient_accumulation_steps=1)

    for _ in range(3):
        step()
    timed = [("step", step)]
    if trainer.graphs is None:  # the eager step alone (the graphed one is replayed inside the step)
        timed.append(("optimizer only", lambda: opt.step(lr=1e-6, grad_clip=1.0)))
    else:
        print(f"CUDA graphs: {trainer.graphs.captures} captured, {trainer.graphs.replays} microbatches replayed")
    for label, fn in timed:
        torch.cuda.synchronize() if device.type == "cuda" else None
        t = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize() if device.type == "cuda" else None
        print(f"{label}: {(time.perf_counter() - t) / 3 * 1e3:.1f} ms wall", flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if args.gaps:
        with profile(activities=acts, with_stack=True) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        print_gaps(prof, args.top or 15)
        return
    with profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize() if device.type == "cuda" else None
    table(prof, args.top or 30)
    if device.type == "cuda":  # which tiles the attention autotuner chose in this process (d128)
        from areno.kernels.attention import packed as attn

        for kind in ("fwd", "dkdv", "dq", "fwd_tma", "bwd_merged_tma"):
            for key, cfg in attn.autotuned(kind, 128).cache.items():
                print(f"autotuned {kind} {key[:4]}: {cfg}")


def decode(args, device):
    from areno.config import SamplingParams
    from areno.engine.engine import Engine, EngineConfig
    from areno.engine.spec_gated import GATED_CHAIN
    from areno.models import load_model, load_tokenizer

    if args.speculative_tokens or args.mtp:  # bench/spec.py's MTP model (its R1 with --spec-gate auto vs plain)
        import spec

        model, tokenizer = load_model(spec.mtp_checkpoint("qwen3_5", args.smoke), device=device), None
    elif args.family in rollout.SHAPES:  # bench/rollout.py's dense / MoE shapes (FP8 rollout's)
        model, tokenizer = rollout.shape_model(args.family, args.smoke, device)
    elif args.family:
        model, tokenizer = families_model(args.family, "rollout", args.smoke, device), None
    else:
        path = models.checkpoint(args.smoke)
        model, tokenizer = load_model(path, device=device), load_tokenizer(path)
    if args.rollout_dtype == "fp8":  # the linear weights and routed experts as blockwise FP8 copies
        from areno.models import fp8_rollout

        fp8_rollout.enable(model)
    n = 8 if args.smoke else args.seqs
    engine = Engine(model, tokenizer, EngineConfig(block_size=16, max_running=n, max_model_len=2064,
                                                   eager_decode=args.eager, decode_steps=args.decode_steps,
                                                   mamba_ssm_cache_dtype=args.state_dtype,
                                                   kv_cache_dtype=args.kv_cache_dtype,
                                                   speculative_tokens=args.speculative_tokens,
                                                   speculative_disable_by_batch_size=args.spec_gate),
                    eos_token_ids=[models.EOS_ID])
    opts = SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True)
    engine.generate(models.random_prompts(n, 128, model.config.vocab_size, seed=1), opts)
    k = args.decode_steps  # enough new tokens that no sequence finishes inside the timed and profiled steps
    per = max(k, GATED_CHAIN) if args.speculative_tokens else k  # a gated scheduling step chains up to that many
    opts = SamplingParams(temperature=1.0, max_new_tokens=args.context + 21 * per + 8, ignore_eos=True)
    for p in models.random_prompts(n, 128, model.config.vocab_size, seed=2):
        engine.add_request(p, opts)
    engine.step()  # prefill
    while engine.scheduler.running and engine.scheduler.running[0].num_computed < 128 + args.context:
        engine.step()  # decode up to the asked context
    torch.cuda.synchronize() if device.type == "cuda" else None
    seqs = list(engine.scheduler.running)
    made = lambda: sum(s.num_output for s in seqs)  # noqa: E731
    t0, before = time.perf_counter(), made()
    for _ in range(10):
        engine.step(k)
    torch.cuda.synchronize() if device.type == "cuda" else None
    steps = (made() - before) / n  # tokens a sequence took: speculation's scheduling steps chain or verify several
    print(f"{n} sequences at ~{128 + args.context} tokens of context: {(time.perf_counter() - t0) * 1e3 / steps:.2f} "
          f"ms a decode step (unprofiled, 10 scheduling steps of {k}: {steps:.0f} tokens a sequence)")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, with_stack=args.gaps) as prof:
        for _ in range(2 if args.gaps else 10):
            engine.step(k)
        torch.cuda.synchronize() if device.type == "cuda" else None
    if args.gaps:
        print_gaps(prof, args.top or 15)
        return
    ex = getattr(engine.runner, "spec_exec", None)  # a steady speculative step replays its verify graph
    replayed = engine.runner.last_step_used_graph or (ex is not None and ex.graphs.bucket is not None)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]  # not their ops too
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / 10
    print(f"10 scheduling steps of {k} decode steps, graph replay: {replayed}; {gpu_ms:.2f} ms of GPU kernels a "
          "scheduling step")
    table(prof, args.top or 40)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["train", "decode"])
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--train-cuda-graphs", default="off", choices=["auto", "on", "off"],
                    help="train: the trainer's CUDA-graph mode (off: the eager step, as before)")
    ap.add_argument("--family", default=None, help="a bench/families.py shape (qwen3_5-9b, qwen3_5-35b-a3b; train: its "
                    "T1 layers) or, decode, bench/rollout.py's 8b / 30b-a3b instead of the Qwen3-0.6B checkpoint")
    ap.add_argument("--optimizer-states", default="fp32", choices=["fp32", "8bit"],
                    help="train: MasterAdamW's moments (8bit: --optimizer-states 8bit's kernels in the table)")
    ap.add_argument("--rollout-dtype", default="bf16", choices=["bf16", "fp8"],
                    help="decode: fp8 profiles FP8 rollout's step (the model's linear weights as FP8 copies)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="decode: the paged cache's dtype (fp8: E4M3 with per-head scales, --kv-cache-dtype fp8)")
    ap.add_argument("--state-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="decode: a hybrid's recurrent state pool (--mamba-ssm-cache-dtype)")
    ap.add_argument("--decode-steps", type=int, default=1, help="decode: steps chained per scheduling step (R1: 8)")
    ap.add_argument("--seqs", type=int, default=256, help="decode: running sequences (128-token prompts)")
    ap.add_argument("--speculative-tokens", type=int, default=0, help="decode: MTP speculation on bench/spec.py's "
                    "Qwen3.5 9B-shaped model, gate auto (at 256 sequences every step is gated: what gating costs)")
    ap.add_argument("--spec-gate", default="auto", help="decode: --speculative-disable-by-batch-size (off: every step "
                    "a verify, the sweep's never-gated speculation)")
    ap.add_argument("--mtp", action="store_true", help="decode: that model without speculation (the plain baseline)")
    ap.add_argument("--context", type=int, default=8, help="decode: tokens generated before the profiled steps")
    ap.add_argument("--shape", default="8x1024", help="train: rows x tokens per row (T1 8x1024, T2 4x4096)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--top", type=int, default=None, help="rows of the profiler table (default 30 train, 40 decode)")
    ap.add_argument("--gaps", action="store_true",
                    help="GPU: instead of the table, where the GPU idles over two (scheduling) steps and what the host "
                         "runs meanwhile (--top gaps, default 15)")
    args = ap.parse_args()
    if args.gaps and not torch.cuda.is_available():
        ap.error("--gaps needs a GPU")
    if args.what != "decode" and (args.state_dtype != "auto" or args.decode_steps != 1):
        ap.error("--state-dtype and --decode-steps apply to the decode profile only")
    if (args.speculative_tokens or args.mtp) and (args.what != "decode" or args.family or args.rollout_dtype != "bf16"):
        ap.error("--speculative-tokens / --mtp: the decode profile of bench/spec.py's model only (bf16, no --family)")
    if args.speculative_tokens < 0:
        ap.error(f"--speculative-tokens must be >= 0, got {args.speculative_tokens}")
    if args.speculative_tokens and args.decode_steps != 1:
        ap.error("--speculative-tokens: speculation chains gated steps itself (leave --decode-steps at 1)")
    if args.decode_steps < 1:
        ap.error(f"--decode-steps must be >= 1, got {args.decode_steps}")
    if args.shape != "8x1024" and (args.what != "train" or args.smoke):
        ap.error("--shape applies to the full train profile only (not decode, not --smoke)")
    if args.optimizer_states != "fp32" and args.what != "train":
        ap.error("--optimizer-states applies to the train profile only")
    if args.what == "train" and args.family in rollout.SHAPES:
        ap.error(f"--family {args.family}: the train profile takes bench/families.py's shapes (qwen3_5-9b, "
                 "qwen3_5-35b-a3b)")
    if (args.rollout_dtype != "bf16" or args.kv_cache_dtype != "auto") and args.what != "decode":
        ap.error("--rollout-dtype and --kv-cache-dtype apply to the decode profile only")
    if args.top is not None and args.top < 1:
        ap.error(f"--top must be >= 1, got {args.top}")
    try:
        args.rows, args.tokens = (int(n) for n in args.shape.lower().split("x"))
    except ValueError:
        ap.error(f"--shape must be ROWSxTOKENS, e.g. 4x4096, got {args.shape!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    (train if args.what == "train" else decode)(args, device)


if __name__ == "__main__":
    main()
