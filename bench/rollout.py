"""R1/R2/R3 rollout: areno's engine (paged KV, CUDA-graph decode) vs transformers ``generate`` (sdpa, bf16).

    python bench/rollout.py             # H200: Qwen3-0.6B shape, random bf16 weights (about 4 minutes)
    python bench/rollout.py --smoke     # CPU: a tiny shape, checks the script (times meaningless)
    python bench/rollout.py --impls areno --workloads R1 --rollout-dtype bf16,fp8 --shape 8b       # FP8 rollout
    python bench/rollout.py --impls areno --workloads R1 --rollout-dtype bf16,fp8 --shape 30b-a3b  # (issue 41)
    python bench/rollout.py --impls areno --workloads R1 --rollout-dtype bf16,fp8 --shape 30b-a3b --layers 32  # 80 GB
    python bench/rollout.py --impls areno --workloads R1,RL --kv-cache-dtype auto,fp8 --shape 8b   # FP8 KV cache
    python bench/rollout.py --speculative-tokens 2 --workloads R3,R2 --mtp-train-steps 300   # MTP speculation

Workloads (BENCH.md), sampling at temperature 1.0, no early stop (``ignore_eos``), log-probs returned:
- R1: 256 prompts of 128 random tokens, 256 new tokens each. Limit: per decode step the weights (1.19 GB) + the KV
  of 256 sequences at mean context 256 (7.5 GB) at 4.3 TB/s = 2.0 ms, about 127k tok/s.
- R2: 256 sequences, prompt and output lengths uniform in [100, 1024] (seed 0). Limit: KV-bound, about 40k tok/s.
- R3: 1 prompt of 128 tokens, 512 new tokens. Limit: 1.19 GB of weights per token at 4.3 TB/s, about 3.6k tok/s.
- RL (long context, for ``--kv-cache-dtype``): 128 prompts of 4,096 random tokens, 512 new tokens each
  (``--max-model-len`` raised to fit): 590k tokens of KV, more than a bf16 cache of half the free memory holds at
  the 8B shape (144 KiB a token), so bf16 preempts and recomputes where fp8's ~1.9x tokens fit more of the batch.

areno: one ``Engine`` (block 16, 256 running, 8192 batched tokens, CUDA graphs on) serves the three workloads in
turn. The first call of each workload includes graph capture and kernel compilation; a second, warm call on fresh
random prompts of the same shape (so the prefix cache cannot help) is the headline. After the warm call the
sampled tokens go through a training forward (the packed ``model(input_ids, positions, cu_seqlens, max_seqlen)``
path, then ``linear_logprobs(hidden, lm_head, targets, temperature=1)``) and the mean |difference| from the
engine's log-probs is reported (the learning check: <= 0.005 in bf16, the issue's bar 0.01).

transformers: ``AutoModelForCausalLM`` from the same checkpoint, sdpa, bf16, ``generate(do_sample=True,
temperature=1, top_p=1, top_k=0, min_new_tokens=max_new_tokens)`` as in
``bench/baselines/transformers_generate_train.py`` (a short warm-up generate first). It is slow, so R2 runs on the
first ``--hf-r2-seqs`` sequences as one left-padded batch (generating to the batch's longest output; only
each sequence's own output length counts as useful tokens) with ``max_time`` as a cap, and R3 generates
``--hf-r3-new`` tokens (tok/s is per token either way).
``--rollout-dtype bf16,fp8`` runs areno once per dtype in the same run, on the same prompts (fp8: the linear weights
and the MoE's routed experts as blockwise FP8 copies, ``areno.models.fp8_rollout``, the experts on
``fused_moe``'s FP8 grouped GEMMs; the log-prob check then against the bf16 forward: the
rollout-vs-trainer mismatch an FP8 rollout brings) and prints fp8's tok/s over bf16's per workload. ``--shape 8b``
(Qwen3-8B dense) and ``30b-a3b`` (Qwen3-30B-A3B MoE) are random bf16 models built on the GPU (N(0, 0.02) weights,
unit norms; areno only; with ``--smoke`` the same family at a tiny fp32 shape, e.g. ``--smoke --shape 30b-a3b
--impls areno --rollout-dtype bf16,fp8`` runs FP8 experts on CPU).
``--kv-cache-dtype auto,fp8`` runs areno once per cache dtype too (fp8: E4M3 K/V with per-token-per-head scales,
``areno.engine.kv_cache``); each record carries the cache's token capacity (``kv_tokens``) and preemptions, and
fp8's tok/s over auto's is printed per workload with both capacities.
One JSON line per measurement goes to bench/results/rollout.jsonl.

``--speculative-tokens K``: MTP speculative decoding instead, each workload with and without it on an MTP family's
random checkpoint (``--mtp-family``; ``--mtp-train-steps`` trains its MTP layer on its own greedy outputs first):
tok/s, the speed-up and the mean accept length (bench/spec.py); ``--spec-gate auto,off`` compares the gate's settings
(R1's bar: auto >= 0.98x plain), ``--spec-batch-sweep`` measures the crossover table (batch 1 to 256).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from common import append_jsonl, env_info, print_table  # noqa: E402

LIMIT_TOK_S = {"R1": 127e3, "R2": 40e3, "R3": 3.6e3}  # BENCH.md hardware limits (H200), the 0.6B shape
SHAPES = {"8b": ("qwen3", models.QWEN3_8B), "30b-a3b": ("qwen3_moe", models.QWEN3_30B_A3B)}
FP8_BARS = {"8b": 1.25, "30b-a3b": 1.35}  # issue 41: R1 fp8 over bf16
SMOKE_MOE = dict(models.SMOKE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
SMOKE_SHAPES = {"8b": models.SMOKE, "30b-a3b": SMOKE_MOE}  # --smoke --shape: the family at a tiny shape, on CPU


def workload(name: str, smoke: bool, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths). ``seed`` draws the token ids; R2's lengths always come from seed 0."""
    if name == "R1":
        n, plen, new = (8, 16, 16) if smoke else (256, 128, 256)
        return models.random_prompts(n, plen, vocab, seed), [new] * n
    if name == "R2":
        n, lo, hi = (8, 10, 40) if smoke else (256, 100, 1024)
        rng = random.Random(0)
        lengths = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]
        return models.random_prompts(n, [p for p, _ in lengths], vocab, seed), [o for _, o in lengths]
    if name == "R3":
        plen, new = (16, 32) if smoke else (128, 512)
        return models.random_prompts(1, plen, vocab, seed), [new]
    if name == "RL":
        n, plen, new = (4, 64, 16) if smoke else (128, 4096, 512)
        return models.random_prompts(n, plen, vocab, seed), [new] * n
    raise ValueError(f"unknown workload {name!r}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- areno


def shape_model(name: str, smoke: bool, device, layers: int | None = None):
    """A random model of ``SHAPES[name]`` (bf16, unit norms; ``smoke``: the family at a tiny fp32 shape, where the
    30b-a3b one runs FP8 experts on CPU; ``layers``: that many decoder layers, else the shape's) and its word
    tokenizer."""
    family, shape = SHAPES[name]
    shape = SMOKE_SHAPES[name] if smoke else shape
    if layers:
        shape = {**shape, "num_hidden_layers": layers}
    dtype = torch.float32 if smoke else torch.bfloat16
    return models.random_model(shape, dtype, device, family=family, unit_norms=True), models.word_tokenizer(
        shape["vocab_size"])


def make_engine(path, device, args, rollout_dtype="bf16", kv_cache_dtype="auto"):
    from areno.engine.engine import Engine, EngineConfig
    from areno.models import fp8_rollout, load_model, load_tokenizer

    if args.shape in SHAPES:
        model, tok = shape_model(args.shape, args.smoke, device, args.layers)
    else:
        model = load_model(path, device=device)
        tok = load_tokenizer(path)
    if rollout_dtype == "fp8":  # every projection but lm_head, and the routed experts (models/fp8_rollout.py)
        before, after = fp8_rollout.enable(model)
        experts = sum(".experts" in n for n in fp8_rollout.fp8_modules(model))
        print(f"fp8 copies: {before / 1e6:,.1f} MB of weights as {after / 1e6:,.1f} MB ({experts} expert stacks)")
    cfg = EngineConfig(
        block_size=16,
        max_running=256,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        eager_decode=args.eager,
        decode_steps=args.decode_steps,
        lookahead=not args.no_lookahead,
        kv_cache_dtype=kv_cache_dtype,
    )
    return Engine(model, tok, cfg, eos_token_ids=[models.EOS_ID]), model


def areno_generate(engine, prompts, new_tokens, device):
    from areno.config import SamplingParams

    opts = [SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True) for n in new_tokens]
    sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, opts)
    sync(device)
    return out, time.perf_counter() - t0


@torch.no_grad()
def logprob_diff(model, completions, device, max_tokens=16384) -> dict:
    """Mean/max |rollout log-prob - training-forward log-prob| over every sampled token."""
    from areno.kernels.logprobs import linear_logprobs
    from areno.training.batch import Row, pack, per_row

    flat = [c for group in completions for c in group]
    diffs = []
    i = 0
    while i < len(flat):
        chunk, n = [], 0
        while i < len(flat) and (not chunk or n + len(flat[i].prompt_ids) + len(flat[i].token_ids) <= max_tokens):
            chunk.append(flat[i])
            n += len(flat[i].prompt_ids) + len(flat[i].token_ids)
            i += 1
        packed = pack([Row(c.prompt_ids, c.token_ids) for c in chunk]).to(device)
        hidden = model(packed.input_ids, packed.positions, cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen)
        lp = linear_logprobs(hidden, model.lm_head_weight, packed.targets, temperature=1.0)
        for c, train_lp in zip(chunk, per_row(lp, packed)):
            diffs.extend(abs(a - b) for a, b in zip(c.logprobs, train_lp))
    return {
        "logprob_diff_mean": sum(diffs) / max(1, len(diffs)),
        "logprob_diff_max": max(diffs, default=0.0),
        "logprob_tokens": len(diffs),
    }


def run_areno(path, device, args, names, vocab, rollout_dtype="bf16", kv_cache_dtype="auto") -> list[dict]:
    from areno.models.fp8_rollout import fp8_forward

    records = []
    engine, model = make_engine(path, device, args, rollout_dtype, kv_cache_dtype)
    print(
        f"areno engine ({rollout_dtype}, KV cache {kv_cache_dtype}): {engine.blocks.num_blocks} KV blocks of 16, "
        f"max_model_len "
        f"{engine.max_model_len}, "
        f"cuda graphs {'off' if args.eager else 'on'}, decode steps per round {args.decode_steps}, "
        f"lookahead {'off' if args.no_lookahead else 'on'}",
        flush=True,
    )
    for name in names:
        for call, seed in (("first", 1), ("warm", 2)):
            rec = dict(impl="areno", workload=name, call=call, decode_steps=args.decode_steps,
                       lookahead=not args.no_lookahead, rollout_dtype=rollout_dtype, kv_cache_dtype=kv_cache_dtype,
                       kv_tokens=engine.blocks.num_blocks * engine.config.block_size)
            preempted = engine.scheduler.num_preemptions
            try:
                prompts, new = workload(name, args.smoke, vocab, seed)
                out, dt = areno_generate(engine, prompts, new, device)
                tokens = sum(len(c.token_ids) for g in out for c in g)
                rec.update(
                    sequences=len(prompts),
                    output_tokens=tokens,
                    wall_s=dt,
                    tok_s=tokens / dt,
                    complete=tokens == sum(new),
                    graphs=len(engine.runner.graphs),
                    preemptions=engine.scheduler.num_preemptions - preempted,
                )
                if name == "R3":
                    rec["ms_per_token"] = dt / tokens * 1e3
                if call == "warm":
                    t0 = time.perf_counter()
                    with fp8_forward(model, on=False):  # the trainer's forward is bf16
                        rec.update(logprob_diff(model, out, device))
                    rec["logprob_check_s"] = time.perf_counter() - t0
            except Exception as e:  # a failing workload is reported, the others still run
                traceback.print_exc()
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
                engine.abort(list(engine.scheduler.running) + list(engine.scheduler.waiting))
            print(fmt(rec), flush=True)
            records.append(rec)
    try:
        engine.drop_rollout_state()
    except Exception:
        traceback.print_exc()
    del engine, model
    return records


# ---------------------------------------------------------------------------------------------- transformers


def load_hf(path, device, smoke):
    import transformers

    dtype = torch.float32 if smoke else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@torch.no_grad()
def hf_generate(model, prompts, new_tokens, device, max_time=None):
    """One left-padded batch to the longest output; returns (useful output tokens, decode steps, wall seconds)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[models.PAD_ID] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    new = max(new_tokens)
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        pad_token_id=models.PAD_ID,
        max_time=max_time,
    )
    sync(device)
    dt = time.perf_counter() - t0
    steps = out.shape[1] - width
    return sum(min(n, steps) for n in new_tokens), steps, dt


def run_hf(path, device, args, names, vocab) -> list[dict]:
    records = []
    model = load_hf(path, device, args.smoke)
    for name in names:
        rec = dict(impl="transformers", workload=name, call="warm")
        try:
            prompts, new = workload(name, args.smoke, vocab, seed=2)
            if name == "R1":
                prompts, new = prompts[: args.hf_r1_prompts], new[: args.hf_r1_prompts]
            elif name == "R2":
                prompts, new = prompts[: args.hf_r2_seqs], new[: args.hf_r2_seqs]
            elif name == "R3" and not args.smoke:
                new = [args.hf_r3_new]
            hf_generate(model, [p[:64] for p in prompts], [8] * len(prompts), device)  # warm-up, as hf_baseline.py
            tokens, steps, dt = hf_generate(model, prompts, new, device, max_time=args.hf_max_time_s)
            rec.update(
                sequences=len(prompts),
                output_tokens=tokens,
                wall_s=dt,
                tok_s=tokens / dt,
                complete=steps >= max(new),
                decode_steps=steps,
            )
            if name == "R3":
                rec["ms_per_token"] = dt / tokens * 1e3
            if steps < max(new):
                rec["note"] = f"stopped by max_time {args.hf_max_time_s}s after {steps} of {max(new)} steps"
            elif name != "R3" and len(prompts) < (8 if args.smoke else 256):
                rec["note"] = f"{len(prompts)} of the sequences"
            elif name == "R3" and not args.smoke:
                rec["note"] = f"{args.hf_r3_new} new tokens"
        except Exception as e:
            traceback.print_exc()
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        print(fmt(rec), flush=True)
        records.append(rec)
    del model
    return records


# ---------------------------------------------------------------------------------------------------- main


def fp8_speedups(records, shape) -> None:
    """fp8's warm tok/s over bf16's per workload (``fp8_speedup`` on the fp8 record), with the issue's R1 bar."""
    warm = {(r["workload"], r.get("rollout_dtype")): r for r in records
            if r.get("impl") == "areno" and r.get("call") == "warm" and "tok_s" in r
            and r.get("kv_cache_dtype", "auto") == "auto"}  # fmt: skip
    for (name, dtype), r in warm.items():
        base = warm.get((name, "bf16"))
        if dtype == "fp8" and base is not None:
            r["fp8_speedup"] = r["tok_s"] / base["tok_s"]
            bar = f" (bar >= {FP8_BARS[shape]}x)" if name == "R1" and shape in FP8_BARS else ""
            print(f"{name} fp8 / bf16: {r['fp8_speedup']:.2f}x{bar}; log-prob |diff| vs the bf16 forward "
                  f"{r.get('logprob_diff_mean', float('nan')):.4f} (bf16 {base.get('logprob_diff_mean', 0):.4f})")


def kv_speedups(records) -> None:
    """The fp8 cache's warm tok/s over the auto cache's per (workload, weights), ``kv_fp8_speedup``, with the token
    capacities of both."""
    warm = {(r["workload"], r.get("rollout_dtype"), r.get("kv_cache_dtype")): r for r in records
            if r.get("impl") == "areno" and r.get("call") == "warm" and "tok_s" in r}  # fmt: skip
    for (name, weights, kv), r in warm.items():
        base = warm.get((name, weights, "auto"))
        if kv == "fp8" and base is not None:
            r["kv_fp8_speedup"] = r["tok_s"] / base["tok_s"]
            print(f"{name} ({weights} weights) KV fp8 / auto: {r['kv_fp8_speedup']:.2f}x; capacity "
                  f"{r['kv_tokens']} tokens vs {base['kv_tokens']} ({r['kv_tokens'] / base['kv_tokens']:.2f}x); "
                  f"preemptions {r['preemptions']} vs {base['preemptions']}; log-prob |diff| "
                  f"{r.get('logprob_diff_mean', float('nan')):.4f} (auto {base.get('logprob_diff_mean', 0):.4f})")


def fmt(rec):
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on any device (checks the script)")
    ap.add_argument("--workloads", default="R1,R2,R3")
    ap.add_argument("--impls", default="areno,transformers")
    ap.add_argument("--eager", action="store_true", help="areno without CUDA graphs (--eager-decode)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps chained per scheduling round (1 = off)")
    ap.add_argument("--no-lookahead", action="store_true",
                    help="areno: read each decode group's tokens before queuing the next (EngineConfig.lookahead)")
    ap.add_argument("--max-model-len", type=int, default=2048 + 16)
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="fraction of free memory or bytes")
    ap.add_argument("--hf-r1-prompts", type=int, default=256)
    ap.add_argument("--hf-r2-seqs", type=int, default=64)
    ap.add_argument("--hf-r3-new", type=int, default=64)
    ap.add_argument("--hf-max-time-s", type=float, default=90.0, help="cap on one transformers generate call")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/rollout.jsonl")
    ap.add_argument("--rollout-dtype", default="bf16", help="areno's linear weights, comma-separated runs: bf16, fp8")
    ap.add_argument("--kv-cache-dtype", default="auto", help="areno's KV cache, comma-separated runs: auto, fp8")
    ap.add_argument("--shape", default="0.6b", choices=("0.6b", *SHAPES), help="8b / 30b-a3b: random models, areno")
    ap.add_argument("--layers", type=int, default=None, help="--shape 8b / 30b-a3b: that many decoder layers at full "
                    "width (default: all; e.g. 32 of 30b-a3b's 48 fit bf16 and its FP8 copy on an 80 GB card)")
    ap.add_argument("--speculative-tokens", type=int, default=0, help="MTP speculation with K draft tokens vs none")
    ap.add_argument("--mtp-family", default="qwen3_5", choices=("qwen3_5", "bailing_hybrid"))
    ap.add_argument("--mtp-train-steps", type=int, default=0, help="train the MTP layer first (own greedy outputs)")
    ap.add_argument("--mtp-fit-rounds", type=int, default=1, help="with --mtp-train-steps: refit on the speculative "
                    "engine's own greedy answers this many rounds in all (bench/spec.py)")
    ap.add_argument("--spec-greedy", action="store_true", help="speculation runs: greedy sampling (temperature 0)")
    ap.add_argument("--spec-gate", default="auto", help="speculation runs: --speculative-disable-by-batch-size "
                    "settings, comma-separated runs: auto, off, N")
    ap.add_argument("--spec-plain-after", action="store_true", help="speculation runs: the plain engine again after "
                    "the speculative ones, the speed-up against the mean of both (bench/spec.py)")
    ap.add_argument("--spec-batches", default=None, help="--spec-batch-sweep's batch sizes, comma-separated "
                    "(default 1,4,16,64,256)")
    ap.add_argument("--spec-batch-sweep", action="store_true", help="speculation: tok/s with and without it at "
                    "batch 1, 4, 16, 64, 256 (the crossover table) instead of the workloads")
    args = ap.parse_args()
    if args.spec_batches is not None:
        try:
            args.spec_batches = tuple(int(b) for b in args.spec_batches.split(","))
        except ValueError:
            ap.error(f"--spec-batches takes comma-separated batch sizes, got {args.spec_batches!r}")
        if not args.spec_batch_sweep or min(args.spec_batches) < 1:
            ap.error("--spec-batches takes sizes >= 1 and applies to --spec-batch-sweep only")
    if args.spec_plain_after and (not args.speculative_tokens or args.spec_batch_sweep):
        ap.error("--spec-plain-after applies to --speculative-tokens runs of the workloads (not --spec-batch-sweep)")
    dtypes, kv_dtypes = args.rollout_dtype.split(","), args.kv_cache_dtype.split(",")
    if not set(kv_dtypes) <= {"auto", "fp8"}:
        ap.error("--kv-cache-dtype takes auto and/or fp8")
    if args.mtp_fit_rounds < 1 or (args.mtp_fit_rounds > 1 and not (args.mtp_train_steps and args.speculative_tokens)):
        ap.error("--mtp-fit-rounds takes 1 or more; above 1 it needs --mtp-train-steps and --speculative-tokens")
    if not set(dtypes) <= {"bf16", "fp8"} or (args.shape in SHAPES and "transformers" in args.impls.split(",")):
        ap.error("--rollout-dtype takes bf16 and/or fp8; --shape 8b / 30b-a3b runs --impls areno only")
    if args.layers is not None and (args.shape not in SHAPES or args.layers < 1):
        ap.error("--layers takes a count >= 1 and applies to --shape 8b / 30b-a3b only")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.max_model_len = 128
    names = args.workloads.split(",")
    if "RL" in names and not args.smoke:  # the long-context workload's prompts and outputs must fit
        args.max_model_len = max(args.max_model_len, 4096 + 512 + 16)
    if "RL" in names and "transformers" in args.impls.split(","):
        ap.error("--workloads RL (long context) runs --impls areno only")
    if args.speculative_tokens:
        return run_speculative(args, device, names)
    big = args.shape in SHAPES and not args.smoke
    shape = SHAPES[args.shape][1] if big else models.shape_of(args.smoke)
    t_start = time.perf_counter()
    path = None if big else models.checkpoint(args.smoke)
    print(f"checkpoint {path or args.shape + ' (random, on the device)'} ({time.perf_counter() - t_start:.1f}s)",
          flush=True)

    records = []
    runs = [(impl, d, kv) for impl in args.impls.split(",") for d in (dtypes if impl == "areno" else ["bf16"])
            for kv in (kv_dtypes if impl == "areno" else ["auto"])]  # fmt: skip
    for impl, dtype, kv in runs:
        t0 = time.perf_counter()
        try:
            if impl == "areno":
                records += run_areno(path, device, args, names, shape["vocab_size"], dtype, kv)
            else:
                records += run_hf(path, device, args, names, shape["vocab_size"])
        except Exception as e:  # e.g. the model fails to load: report it, keep the other implementation
            traceback.print_exc()
            records.append(dict(impl=impl, workload=",".join(names), rollout_dtype=dtype, kv_cache_dtype=kv,
                                error=f"{type(e).__name__}: {e}"[:300]))  # fmt: skip
        free(device)
        print(f"{impl} done in {time.perf_counter() - t0:.1f}s", flush=True)

    hf = {r["workload"]: r for r in records if r.get("impl") == "transformers" and "tok_s" in r}
    for r in records:
        if "tok_s" not in r:
            continue
        if not args.smoke and not big and r["workload"] in LIMIT_TOK_S:
            r["limit_tok_s"] = LIMIT_TOK_S[r["workload"]]
            r["frac_limit"] = r["tok_s"] / r["limit_tok_s"]
        if r["impl"] == "areno" and r["workload"] in hf:
            r["speedup_vs_hf"] = r["tok_s"] / hf[r["workload"]]["tok_s"]
    fp8_speedups(records, None if args.smoke else args.shape)
    kv_speedups(records)
    cols = ["impl", "rollout_dtype", "kv_cache_dtype", "workload", "call", "sequences", "output_tokens", "wall_s",
            "tok_s", "ms_per_token", "frac_limit", "speedup_vs_hf", "fp8_speedup", "kv_tokens", "preemptions",
            "kv_fp8_speedup", "logprob_diff_mean", "logprob_diff_max", "note", "error"]  # fmt: skip
    print_table(records, cols)
    warm = {r["workload"]: r for r in records if r.get("impl") == "areno" and r.get("call") == "warm"
            and r.get("rollout_dtype") == dtypes[0] and r.get("kv_cache_dtype") == kv_dtypes[0]}
    if "R1" in warm and "speedup_vs_hf" in warm["R1"]:
        print(
            f"R1 bar (>= 10x transformers): {warm['R1']['speedup_vs_hf']:.1f}x; goal 60% of the limit: "
            f"{warm['R1'].get('frac_limit', float('nan')):.0%}"
        )
    if "R3" in warm and "tok_s" in warm["R3"]:
        print(f"R3 bar (>= 500 tok/s; goal 1,000): {warm['R3']['tok_s']:.0f} tok/s")
    diffs = [r["logprob_diff_mean"] for r in warm.values() if "logprob_diff_mean" in r]
    if diffs:
        print(f"log-prob |diff| bar (<= 0.01; goal 0.005): worst workload mean {max(diffs):.4f}")
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = "qwen3-0.6b" if not big else {"8b": "qwen3-8b", "30b-a3b": "qwen3-30b-a3b"}[args.shape]
        if args.layers:
            env.update(shape=f"{env['shape']}-{args.layers}l", layers=args.layers)
        print("results:", append_jsonl("rollout", records, env))


def run_speculative(args, device, names):
    import spec

    if args.spec_batch_sweep:
        records = spec.run_batch_sweep(args, device)
        print_table(records, ["workload", "family", "speculative_tokens", "batch", "output_tokens", "wall_s", "tok_s",
                              "spec_accept_len", "speedup_vs_plain", "accept_needed", "auto_limit", "mtp_loss_last",
                              "greedy_same", "first_diff_mean"])
        print(spec.crossover(records))
    else:
        records = spec.run_spec(args, device, names, workload)
        print_table(records, ["workload", "call", "family", "speculative_tokens", "spec_gate", "spec_limit",
                              "plain_pass", "sequences", "output_tokens", "wall_s", "tok_s", "spec_accept_len",
                              "spec_gated_steps", "speedup_vs_plain", "preemptions", "kv_tokens", "steps_single",
                              "steps_chained", "graphs_captured", "mtp_loss_last", "greedy_same", "first_diff_mean",
                              "error"])
        r1 = [r for r in records if r["workload"] == "R1" and r.get("spec_gate") == "auto" and r["call"] == "warm"]
        if r1 and "speedup_vs_plain" in r1[0]:
            print(f"R1 bar (speculation with the gate auto never slower than 0.98x plain): "
                  f"{r1[0]['speedup_vs_plain']:.3f}x ({r1[0]['spec_gated_steps']} steps gated, N = "
                  f"{r1[0]['spec_limit']})")
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = f"{args.mtp_family}-bench"
        print("results:", append_jsonl("rollout", records, env))


if __name__ == "__main__":
    main()
