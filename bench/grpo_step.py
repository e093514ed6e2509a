"""G1: one colocated GRPO step, areno's ``TrainLoop`` vs TRL's ``GRPOTrainer``, same model, batch and GPU.

    python bench/grpo_step.py           # H200: Qwen3-0.6B shape, random bf16 weights (about 4 minutes)
    python bench/grpo_step.py --smoke   # CPU: a tiny shape, 4 prompts x 4 samples (times meaningless)
    python bench/grpo_step.py --split   # also split mode, sync and async: train on GPU 0, rollout on GPU 1
    python bench/grpo_step.py --split --tail --impls none   # G2: long-tailed lengths, sync split vs partial rollout
    python bench/grpo_step.py --impls areno --rollout-dtypes bf16,fp8   # issue 41: G1 with FP8 rollout beside bf16
    python bench/grpo_step.py --impls areno --rollout-dtypes bf16,fp8 --kv-cache-dtypes auto,fp8   # FP8 KV cache too

The batch (BENCH.md G1): 32 prompts of 128 random tokens, 8 samples each (256 completions), up to 512 new tokens at
temperature 1 (EOS may stop a completion; with random weights almost none stops early: see response_len), bf16,
one optimizer update per step over the 256 completions in 8 microbatches of 32, lr 1e-6, no KL (beta 0), no
gradient checkpointing (TRL's setting; areno's default is on, ``--checkpointing on`` runs that too). The reward is
``bench/grpo_reward.py`` (text length parity), the same function TRL's baseline used.

- areno: ``TrainLoop(TrainConfig(algo="grpo", ...))`` from the cached checkpoint and a jsonl of the prompts (as
  text ``"t5 t77 ..."``, which the checkpoint's word-level tokenizer maps back to the same 128 ids); ``setup()``
  then ``step(batch)`` per step, the loop's own phases: rollout (the decode, CUDA graphs), reward (the wait for
  the scores after the decode: groups that finished earlier were scored, and their rows tensorised, on a background
  thread while the rest decoded; ``overlap_saved_s`` is that hidden work, ``reward_work_s`` all of it), pack (rows,
  advantages and filters before the update), log-probs (the trainer's recomputation of the rollout tokens when it
  is a separate pass), train (the GRPO update; its microbatches are packed inside it), and other (the rest of the
  step's wall time).
- TRL: ``GRPOTrainer`` set up as ``bench/baselines/peers_liger_trl.py`` (G1): the synthetic word-level tokenizer
  of 151,936 tokens (its special tokens fixed to match whole words only: see bench/models.py), 128 prompts,
  ``per_device_train_batch_size=32, gradient_accumulation_steps=8, num_generations=8, max_completion_length=512``,
  HF generate, no vLLM; it measured 30-32 s per step (61 s for the first), 52 GiB peak. Here it loads the same
  checkpoint (the baseline drew its own random weights). TRL is not installed by areno: its wheel (with datasets,
  dill, multiprocess) must be on PYTHONPATH; without it only areno is measured.
G2 (``--split --tail``, issue 42): the split runs stop a completion at the stop string ``TAIL_STOP`` (about 0.7% of
the full vocabulary's word tokens start with it: completion lengths are geometric, median about 95 tokens, and about
2% of the 256 reach the 512 cap, so every synchronous step waits for its longest few); measured are the synchronous
split step (``--max-staleness 0``) and the partial-rollout one (``--max-staleness 2 --partial-rollout
--max-tail-steps`` ``--tail-steps``); the bar is partial >= 1.5x the synchronous step.
Steady state = mean of the steps after the first (``--steps``, default 3). Peak memory: torch.cuda.max_memory_allocated
over the measured steps (areno's includes its KV cache, sized to the batch: 256 x 640 tokens, about 19 GB).
One JSON line per implementation goes to bench/results/grpo_step.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import models  # noqa: E402
from common import append_jsonl, env_info, print_table  # noqa: E402

REWARD_FILE = os.path.join(BENCH, "grpo_reward.py")
TAIL_STOP = " t99"  # --tail: a stop string that about 0.7% of the word tokens "t<id>" (ids below 151,936) start with
SPLIT_MODES = {"sync": ["--max-staleness", "0"], "async": ["--max-staleness", "1"],
               "partial": ["--max-staleness", "2", "--partial-rollout"]}
PHASES = ("rollout_s", "reward_s", "pack_s", "logprob_s", "train_s")
OVERLAP = ("overlap_saved_s", "reward_work_s")  # work hidden under the decode, all scoring work


def sizes(smoke: bool) -> dict:
    if smoke:
        return dict(prompts=4, samples=4, prompt_len=16, new=32, mini_bs=4, accum=4)
    return dict(prompts=32, samples=8, prompt_len=128, new=512, mini_bs=32, accum=8)


def prompt_texts(s: dict, vocab: int) -> list[str]:
    """4 batches' worth of prompts, as TRL's baseline made (32 x 4)."""
    return [models.prompt_text(p) for p in models.random_prompts(s["prompts"] * 4, s["prompt_len"], vocab, seed=0)]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def run_areno(path, texts, s, ckpt, args, tmp, graphs="auto", extra: dict | None = None) -> dict:
    """``extra``: more TrainConfig fields (bench/lora_step.py's LoRA and QLoRA settings)."""
    from areno.config import TrainConfig
    from areno.rl.loop import TrainLoop

    data = os.path.join(tmp, "prompts.jsonl")
    with open(data, "w") as f:
        for t in texts:
            f.write(json.dumps({"prompt": t}) + "\n")
    cfg = TrainConfig(
        ckpt=str(path),
        dataset_path=data,
        reward_fn_path=REWARD_FILE,
        algo="grpo",
        batch_size=s["prompts"],
        n_samples=s["samples"],
        max_prompt_tokens=s["prompt_len"],
        max_new_tokens=s["new"],
        temperature=1.0,
        mini_bs=s["mini_bs"],
        gradient_accumulation_steps=s["accum"],
        lr=1e-6,
        activation_checkpointing=ckpt,
        dtype="float32" if args.smoke else "bfloat16",
        max_steps=args.steps,
        seed=0,
        tensorboard=False,
        metrics_dir=os.path.join(tmp, "metrics"),
        kv_cache_memory=args.kv_cache_memory,
        train_cuda_graphs=graphs,
        **(extra or {}),
    )
    rec = dict(impl="areno", checkpointing=ckpt, train_cuda_graphs=graphs, rollout_dtype=cfg.rollout_dtype,
               kv_cache_dtype=cfg.kv_cache_dtype)
    loop = TrainLoop(cfg)
    t0 = time.perf_counter()
    loop.setup()
    rec["setup_s"] = time.perf_counter() - t0
    assert len(loop.rows[0].ids) == s["prompt_len"], "the word-level tokenizer did not round-trip"
    steps = []
    try:
        batches = iter(loop.data)
        for i in range(args.steps):
            batch = next(batches)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            m = loop.step(batch)
            sync()
            m["step_s"] = time.perf_counter() - t0
            if torch.cuda.is_available():
                m["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                m["reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            loop.step_index += 1
            steps.append(m)
            print(f"areno step {i + 1}: " + ", ".join(
                f"{k} {m[k]:.4g}" for k in ("step_s",) + PHASES + OVERLAP + ("logprob_diff", "response_len_mean",
                                                                              "rollout_tok_s", "reward_mean",
                                                                              "peak_gib")
                if isinstance(m.get(k), (int, float))), flush=True)  # fmt: skip
    finally:
        loop.close()
        engine = getattr(loop.engine, "engine", None)  # the colocated rollout's Engine
        if engine is not None and not engine.has_work():
            engine.drop_rollout_state()
        del loop
    later = steps[1:] or steps
    rec.update(
        steps=len(steps), step_s_all=[round(m["step_s"], 3) for m in steps], step_s=mean([m["step_s"] for m in later])
    )
    for k in PHASES + OVERLAP + ("logprob_diff", "response_len_mean", "rollout_tok_s", "train_tok_s", "reward_mean"):
        vals = [m[k] for m in later if isinstance(m.get(k), (int, float))]
        if vals:
            rec[k] = mean(vals)
    rec["other_s"] = rec["step_s"] - sum(rec.get(k, 0.0) for k in PHASES)
    if any("peak_gib" in m for m in later):
        rec["peak_gib"] = max(m.get("peak_gib", 0.0) for m in later)
        rec["reserved_gib"] = max(m.get("reserved_gib", 0.0) for m in later)
    return rec


def run_areno_split(path, texts, s, ckpt, args, tmp, mode: str) -> dict:
    """The same steps through ``areno train`` in split mode (train rank on device 0, a rollout engine on device 1),
    ``mode`` a key of SPLIT_MODES: sync (``--max-staleness 0``), async (1: the next rollout runs while this step
    trains) or partial (2, partial rollout, its tail cut after ``--tail-steps`` rounds); ``--tail``: long-tailed
    lengths (TAIL_STOP). Per-step times and phases from its metrics.jsonl (step_s there is the loop's wall time per
    step, idle waits included)."""
    import subprocess

    data = os.path.join(tmp, "prompts.jsonl")
    with open(data, "w") as f:
        for t in texts:
            f.write(json.dumps({"prompt": t}) + "\n")
    out = os.path.join(tmp, f"split-{mode}")
    cmd = [sys.executable, "-m", "areno", "train", "--ckpt", str(path), "--dataset-path", data, "--reward-fn-path",
           REWARD_FILE, "--algo", "grpo", "--batch-size", str(s["prompts"]), "--n-samples", str(s["samples"]),
           "--max-prompt-tokens", str(s["prompt_len"]), "--max-new-tokens", str(s["new"]), "--temperature", "1.0",
           "--mini-bs", str(s["mini_bs"]), "--gradient-accumulation-steps", str(s["accum"]), "--lr", "1e-6",
           "--activation-checkpointing" if ckpt else "--no-activation-checkpointing",
           "--dtype", "float32" if args.smoke else "bfloat16", "--max-steps", str(args.steps), "--seed", "0",
           "--no-tensorboard", "--metrics-dir", out, "--train-devices", "0", "--rollout-devices", "1",
           *SPLIT_MODES[mode]]
    if mode == "partial":
        cmd += ["--max-tail-steps", str(args.tail_steps)]
    if args.tail:
        cmd += ["--stop", TAIL_STOP]
    if args.kv_cache_memory is not None:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=os.path.dirname(BENCH)), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"areno train (split, {mode}) failed: {proc.stderr[-2000:]}")
    steps = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"step_s"' in x]
    later = steps[1:] or steps
    rec = dict(impl=f"areno-split-{mode}" + ("-tail" if args.tail else ""), checkpointing=ckpt, steps=len(steps),
               step_s_all=[round(m["step_s"], 3) for m in steps], step_s=mean([m["step_s"] for m in later]))
    for k in PHASES + OVERLAP + ("logprob_diff", "response_len_mean", "rollout_tok_s", "train_tok_s", "reward_mean",
                                 "policy_sync_time_s", "policy_sync_gbps", "train_idle_s", "rollout_idle_s",
                                 "staleness_max", "response_len_max", "tail_cut", "stale_dropped", "samples"):
        vals = [m[k] for m in later if isinstance(m.get(k), (int, float))]
        if vals:
            rec[k] = mean(vals)
    return rec


def run_trl(path, texts, s, args, tmp, peft_config=None) -> dict:
    """``peft_config``: a ``peft.LoraConfig`` for GRPOTrainer (bench/lora_step.py's TRL + PEFT baseline)."""
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    vocab = models.shape_of(args.smoke)["vocab_size"]
    tok = models.word_tokenizer(vocab)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    ds = Dataset.from_dict({"prompt": texts})

    def reward(completions, **kw):
        return [float(len(c) % 2) for c in completions]

    extra = dict(use_cpu=True, bf16=False) if args.smoke else dict(bf16=True)
    targs = GRPOConfig(
        output_dir=os.path.join(tmp, "trl-out"),
        per_device_train_batch_size=s["mini_bs"],
        gradient_accumulation_steps=s["accum"],
        num_generations=s["samples"],
        max_completion_length=s["new"],
        learning_rate=1e-6,
        logging_steps=1,
        max_steps=args.steps,
        report_to="none",
        save_strategy="no",
        temperature=1.0,
        top_k=0,
        use_vllm=False,
        gradient_checkpointing=False,
        beta=0.0,
        **extra,
    )
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, st, c, **kw):
            sync()
            stamps.append(time.perf_counter())
            print(f"trl step {len(stamps)}: {stamps[-1] - (stamps[-2] if len(stamps) > 1 else t0):.2f}s", flush=True)

    tr = GRPOTrainer(
        model=model, reward_funcs=reward, args=targs, train_dataset=ds, processing_class=tok, callbacks=[Clock()],
        **({} if peft_config is None else dict(peft_config=peft_config)),
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    tr.train()
    steps = [b - a for a, b in zip([t0] + stamps[:-1], stamps)]
    later = steps[1:] or steps
    rec = dict(
        impl=f"trl {trl.__version__}",
        checkpointing=False,
        steps=len(steps),
        step_s_all=[round(x, 3) for x in steps],
        step_s=mean(later),
    )
    if torch.cuda.is_available():
        rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rec["reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    lens = [h[k] for h in tr.state.log_history for k in h if k in ("completions/mean_length", "completion_length")]
    if lens:
        rec["response_len_mean"] = lens[-1]
    del tr, model
    return rec


def bf16_twin(records: list[dict], r: dict) -> dict | None:
    """For an areno row with FP8 rollout or an FP8 KV cache, the bf16 row (bf16 KV cache) of the same
    checkpointing and graph setting (else None)."""
    fp8 = r.get("rollout_dtype") == "fp8" or r.get("kv_cache_dtype") == "fp8"
    if r["impl"] != "areno" or not fp8 or not r.get("step_s"):
        return None
    same = lambda b: (b.get("checkpointing"), b.get("train_cuda_graphs")) == (r.get("checkpointing"),  # noqa: E731
                                                                              r.get("train_cuda_graphs"))
    return next((b for b in records if b["impl"] == "areno" and b.get("rollout_dtype") == "bf16" and b.get("step_s")
                 and b.get("kv_cache_dtype", "auto") == "auto" and same(b)), None)  # fmt: skip


def breakdown(r: dict) -> str:
    """One line: where an areno step's wall time goes (steady-state means), and the scoring work the overlap hid."""
    names = dict(rollout_s="rollout", reward_s="reward wait", pack_s="pack", logprob_s="log-probs", train_s="update",
                 other_s="other")
    parts = [f"{names[k]} {r[k]:.3f}s ({r[k] / r['step_s']:.0%})" for k in names if isinstance(r.get(k), float)]
    line = f"{r['impl']} step {r['step_s']:.3f}s = " + " + ".join(parts)
    if "overlap_saved_s" in r:
        line += (f"; scoring work {r.get('reward_work_s', 0.0):.3f}s, of which {r['overlap_saved_s']:.3f}s hidden "
                 "under the decode (overlap saved)")
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shape, tiny batch (checks the script)")
    ap.add_argument("--impls", default="areno,trl")
    ap.add_argument("--checkpointing", default="off", help="areno activation checkpointing: off, on or off,on")
    ap.add_argument("--steps", type=int, default=3, help="steps per implementation; the first is not averaged")
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="areno KV budget (fraction or bytes)")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/grpo_step.jsonl")
    ap.add_argument("--train-cuda-graphs", default="auto", help="areno's --train-cuda-graphs: auto (eager in "
                    "colocated RL), on, off, or a comma list measured in turn (e.g. off,on)")
    ap.add_argument("--rollout-dtypes", default="bf16", help="areno's --rollout-dtype, one run each: bf16, fp8 or "
                    "bf16,fp8 (issue 41: G1 with FP8 rollout beside bf16's)")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="areno's --kv-cache-dtype, one run each (times each "
                    "rollout dtype): auto, fp8 or auto,fp8")
    ap.add_argument("--split", action="store_true", help="also areno in split mode, sync and async (2 devices)")
    ap.add_argument("--tail", action="store_true", help="with --split: long-tailed completion lengths, the sync "
                    "split step vs partial rollout (G2, issue 42)")
    ap.add_argument("--tail-steps", type=int, default=16, help="--tail: the partial run's --max-tail-steps")
    args = ap.parse_args()
    s = sizes(args.smoke)
    shape = models.shape_of(args.smoke)
    t_start = time.perf_counter()
    path = models.checkpoint(args.smoke)
    print(f"checkpoint {path} ({time.perf_counter() - t_start:.1f}s)", flush=True)
    texts = prompt_texts(s, shape["vocab_size"])

    records = []
    with tempfile.TemporaryDirectory() as tmp:
        impls = [i for i in args.impls.split(",") if i != "none"]
        if args.tail and not args.split:
            ap.error("--tail needs --split")
        bad = [d for d in args.kv_cache_dtypes.split(",") if d not in ("auto", "fp8")]
        if bad:
            ap.error(f"--kv-cache-dtypes: auto or fp8 each, got {bad}")
        if (args.rollout_dtypes, args.kv_cache_dtypes) != ("bf16", "auto") and ("areno" not in impls or args.split):
            ap.error("--rollout-dtypes / --kv-cache-dtypes apply to the colocated areno runs only (--impls areno, "
                     "without --split)")
        if args.split:
            impls[1:1] = [f"areno-split-{m}" for m in (("sync", "partial") if args.tail else ("sync", "async"))]
        for impl in impls:
            variants = [c == "on" for c in args.checkpointing.split(",")] if impl.startswith("areno") else [False]
            graph_modes = args.train_cuda_graphs.split(",") if impl == "areno" else [None]
            dtypes = args.rollout_dtypes.split(",") if impl == "areno" else [None]
            kvs = args.kv_cache_dtypes.split(",") if impl == "areno" else [None]
            for ckpt, graphs, dtype, kv in [(c, g, d, k) for c in variants for g in graph_modes for d in dtypes
                                            for k in kvs]:  # fmt: skip
                t0 = time.perf_counter()
                try:
                    if impl == "areno":
                        rec = run_areno(path, texts, s, ckpt, args, tmp, graphs, extra={"rollout_dtype": dtype,
                                                                                        "kv_cache_dtype": kv})
                    elif impl.startswith("areno-split"):
                        rec = run_areno_split(path, texts, s, ckpt, args, tmp, impl.removeprefix("areno-split-"))
                    else:
                        try:
                            import trl  # noqa: F401
                        except ImportError as e:
                            print(
                                f"note: trl is not importable ({e}); only areno is measured. Put TRL 1.16 and its "
                                "missing dependencies on PYTHONPATH (see bench/README.md)",
                                flush=True,
                            )
                            continue
                        rec = run_trl(path, texts, s, args, tmp)
                except Exception as e:  # one failing side is reported, the other still runs
                    traceback.print_exc()
                    rec = dict(impl=impl, checkpointing=ckpt, error=f"{type(e).__name__}: {e}"[:300])
                rec["wall_s"] = time.perf_counter() - t0
                rec.update(prompts=s["prompts"], samples=s["samples"], prompt_len=s["prompt_len"], max_new=s["new"])
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
                records.append(rec)
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    trl_rec = next((r for r in records if r["impl"].startswith("trl") and r.get("step_s")), None)
    for r in records:
        if r["impl"].startswith("areno") and r.get("step_s") and trl_rec:
            r["speedup_vs_trl"] = trl_rec["step_s"] / r["step_s"]
        bf16 = bf16_twin(records, r)
        if bf16:
            r["speedup_vs_bf16"] = bf16["step_s"] / r["step_s"]  # issue 41: FP8 rollout's G1 against bf16's
    cols = ["impl", "checkpointing", "train_cuda_graphs", "rollout_dtype", "kv_cache_dtype", "step_s", "rollout_s",
            "reward_s", "pack_s", "logprob_s", "train_s", "other_s", "overlap_saved_s", "response_len_mean",
            "logprob_diff",
            "policy_sync_time_s", "train_idle_s", "staleness_max", "tail_cut", "peak_gib", "speedup_vs_trl",
            "speedup_vs_bf16", "speedup_vs_sync_split", "step_s_all", "error"]  # fmt: skip
    print_table(records, cols)
    for r in records:
        if r["impl"].startswith("areno") and r.get("step_s"):
            print(breakdown(r), flush=True)
    for r in records:
        if "speedup_vs_trl" in r:
            print(
                f"G1 bar (>= 6x TRL; goal 7x, 2.8 s/step), {r['impl']}, checkpointing "
                f"{'on' if r['checkpointing'] else 'off'}: "
                f"{r['speedup_vs_trl']:.1f}x ({r['step_s']:.2f} s vs {trl_rec['step_s']:.2f} s)"
            )
    sync_rec = next((r for r in records if r["impl"].startswith("areno-split-sync") and r.get("step_s")), None)
    for r in records:
        if r["impl"].startswith("areno-split-partial") and r.get("step_s") and sync_rec:
            r["speedup_vs_sync_split"] = sync_rec["step_s"] / r["step_s"]
            print(f"G2 bar (partial rollout + K = 2 >= 1.5x the synchronous split step{', long tail' * args.tail}): "
                  f"{r['speedup_vs_sync_split']:.2f}x ({r['step_s']:.2f} s vs {sync_rec['step_s']:.2f} s)")
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = "qwen3-0.6b"
        print("results:", append_jsonl("grpo_step", records, env))


if __name__ == "__main__":
    main()
