"""G1-lora / G8B-lora / G32B-qlora: one LoRA (QLoRA) GRPO step through areno's train path, and TRL + PEFT's.

    python bench/lora_step.py                       # H200: 0.6B (areno, TRL + PEFT) and 8B shapes (about 8 minutes)
    python bench/lora_step.py --shapes none --qlora # H200: the 32B shape with --quantize-base nf4 only
    python bench/lora_step.py --smoke               # CPU: tiny shapes and batch (checks the script; times meaningless)

The areno side is ``bench/grpo_step.py``'s ``run_areno`` (``TrainLoop(TrainConfig(algo="grpo", ...))``, ``setup()``
then ``step(batch)``: what ``areno train --algo grpo --lora-rank 32 --lora-alpha 64 --lora-target-modules
all-linear`` runs) with the LoRA fields added. Shapes:

- 0.6b (workload G1-lora): the cached Qwen3-0.6B-shape checkpoint and G1's batch (32 prompts x 8 samples, 128
  prompt tokens, up to 512 new, 8 microbatches of 32, no activation checkpointing); TRL's ``GRPOTrainer`` with a
  ``peft.LoraConfig`` of the same rank, alpha and targets beside it (skipped with the reason if trl/peft are absent).
- 8b (G8B-lora): Qwen3-8B's config (hidden 4096, 36 layers, 32/8 heads, intermediate 12288, untied), random bf16
  weights drawn on the GPU (no checkpoint is written: areno's loader builds the model, the weights are filled in
  place); 64 prompts x 8 samples x 512 new tokens, 16 microbatches of 32, activation checkpointing on.
- ``--qlora`` (G32B-qlora): Qwen3-32B's config (hidden 5120, 64 layers, 64/8 heads, intermediate 25600), random
  weights on the GPU, ``--quantize-base nf4`` (each projection quantised as it is drawn, as areno's loader does as it
  reads one: the build time is printed and recorded as ``build_s``, the load's memory peak, the NF4 base plus one
  projection in bf16, as ``load_peak_gib``); 8 prompts x 4 samples x 256 new tokens, one microbatch, checkpointing on.

Per row: step_s (mean of the steps after the first), the split as G1 rows give it (rollout_s; logprob_s: the
reference and old log-probs, none at beta 0 when the rollout's own log-probs serve; train_s: the update; reward_s,
pack_s, other_s), peak_gib / reserved_gib (torch.cuda.max_memory_allocated / max_memory_reserved over the measured
steps), and on the TRL + PEFT row areno_speedup (its step over areno's on 0.6B; issue 39's bar: >= 5x). Each row is
printed and appended to bench/results/lora_step.jsonl as soon as it is measured (a timeout keeps the rows done).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import grpo_step  # noqa: E402
import models  # noqa: E402
from common import append_jsonl, env_info, print_table  # noqa: E402

RANK, ALPHA, TARGETS = 32, 64, "all-linear"
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6,
                max_position_embeddings=40960)  # fmt: skip
QWEN3_32B = {**QWEN3_8B, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
             "num_attention_heads": 64}  # fmt: skip
SMOKE_BUILT = {**models.SMOKE, "tie_word_embeddings": False}  # the built path on CPU, at the smoke size
G1 = grpo_step.sizes(False)
CASES = {  # name: (workload, shape or None for G1's cached checkpoint, batch, activation checkpointing, extra)
    "0.6b": ("G1-lora", None, G1, False, {}),
    "8b": ("G8B-lora", QWEN3_8B, {**G1, "prompts": 64, "accum": 16}, True, {}),
    "32b-qlora": ("G32B-qlora", QWEN3_32B, dict(prompts=8, samples=4, prompt_len=128, new=256, mini_bs=32, accum=1),
                  True, {"quantize_base": "nf4"}),
}


def write_config(folder: Path, shape: dict, dtype) -> Path:
    """A model folder with config.json, the word-level tokenizer and one placeholder tensor, no weights: the
    weights are drawn on the device by ``random_weights`` while areno's loader builds the model."""
    from safetensors.torch import save_file

    from areno.testing.checkpoints import tiny_config

    folder.mkdir(parents=True, exist_ok=True)
    ids = dict(bos_token_id=models.PAD_ID, eos_token_id=models.EOS_ID, pad_token_id=models.PAD_ID)
    config = tiny_config("qwen3", dtype=dtype, rms_norm_eps=1e-6, **ids, **shape)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(ids) + "\n")
    tok = models.word_tokenizer(shape["vocab_size"])
    tok.model_max_length = shape["max_position_embeddings"]
    tok.save_pretrained(folder)
    save_file({"placeholder": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


@contextlib.contextmanager
def random_weights(timing: dict):
    """While open, areno's loader fills each model's parameters in place on their device (std 0.02, norms 1)
    instead of reading a checkpoint, the loader's ``deferred`` weights (--quantize-base nf4) made and quantised one
    at a time as it does; ``timing["build_s"]`` is the time spent filling, ``timing["load_peak_gib"]`` the GPU memory
    peak then (the load's: with nf4 the NF4 base, the rest in bf16 and one projection's bf16 weight)."""
    from areno.models import loader

    real = loader.load_hf_weights

    @torch.no_grad()
    def fill(model, source, deferred=None):
        t0 = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # from the materialised model on: earlier cases' peaks left out
        gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(0)
        drawn = 0
        for name, p in list(model.named_parameters()):  # listed first: a deferred weight leaves its module
            with (deferred or {}).get(name) or contextlib.nullcontext(p) as t:  # nf4: quantised on leaving
                if t.dim() == 1:
                    t.fill_(1.0)
                else:
                    t.normal_(0.0, 0.02, generator=gen)
                drawn += t.numel()
            del t
        grpo_step.sync()
        timing["build_s"] = timing.get("build_s", 0.0) + time.perf_counter() - t0
        if torch.cuda.is_available():
            timing["load_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"random weights: {drawn / 1e9:.2f}B parameters drawn in {timing['build_s']:.1f}s", flush=True)

    loader.load_hf_weights = fill
    try:
        yield
    finally:
        loader.load_hf_weights = real


def lora_fields(extra: dict) -> dict:
    return dict(lora_rank=RANK, lora_alpha=float(ALPHA), lora_target_modules=TARGETS, **extra)


def run_case(name: str, args, tmp: str, impl: str) -> dict:
    workload, shape, s, ckpt, extra = CASES[name]
    if args.smoke:
        s = {**grpo_step.sizes(True), **({"accum": 1} if extra else {})}
    rec = dict(workload=workload, shape=name, impl=impl, lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS,
               quantize_base=extra.get("quantize_base", "none"))
    timing: dict = {}
    t0 = time.perf_counter()
    try:
        if shape is None:
            path = models.checkpoint(args.smoke)
            vocab = models.shape_of(args.smoke)["vocab_size"]
        else:
            shape = SMOKE_BUILT if args.smoke else shape
            path = write_config(Path(tmp) / f"model-{name}", shape, torch.float32 if args.smoke else torch.bfloat16)
            vocab = shape["vocab_size"]
        texts = grpo_step.prompt_texts(s, vocab)
        if impl == "areno":
            with random_weights(timing) if shape is not None else contextlib.nullcontext():
                out = grpo_step.run_areno(path, texts, s, ckpt, args, tmp, "auto", lora_fields(extra))
        else:
            import peft
            from peft import LoraConfig

            peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0,
                                     task_type="CAUSAL_LM")
            out = grpo_step.run_trl(path, texts, s, args, tmp, peft_config)
            out["impl"] = f"{out['impl']} + peft {peft.__version__}"
        rec.update({k: v for k, v in out.items() if k != "impl"}, impl=out["impl"], **timing)
    except Exception as e:  # one failing case is reported, the others still run
        traceback.print_exc()
        rec.update(checkpointing=ckpt, error=f"{type(e).__name__}: {e}"[:300], **timing)
    rec.update(wall_s=time.perf_counter() - t0, prompts=s["prompts"], samples=s["samples"],
               prompt_len=s["prompt_len"], max_new=s["new"], micro_bs=s["mini_bs"], accum=s["accum"])
    return rec


def missing_baseline() -> str | None:
    """Why TRL + PEFT cannot run here (None if both import)."""
    try:
        import peft  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        return f"{e}; put TRL 1.16 (and its dependencies) and peft on PYTHONPATH (see bench/README.md)"
    return None


def emit(rec: dict, records: list, args, env: dict) -> None:
    """Print one row and append it to bench/results/lora_step.jsonl at once (unless --smoke / --no-save)."""
    areno = next((r for r in records if r["impl"] == "areno" and r["shape"] == "0.6b" and r.get("step_s")), None)
    if rec["impl"].startswith("trl") and rec.get("step_s") and areno:  # areno ran first: its row is already out
        rec["areno_speedup"] = rec["step_s"] / areno["step_s"]
    records.append(rec)
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
    if rec["impl"] == "areno" and rec.get("step_s"):
        print(grpo_step.breakdown({**rec, "impl": f"{rec['workload']} {rec['impl']}"}), flush=True)
    if not args.no_save and not args.smoke:
        append_jsonl("lora_step", [rec], env)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, tiny batch, CPU (checks the script)")
    ap.add_argument("--shapes", default="0.6b,8b", help="comma list of 0.6b, 8b (none: neither)")
    ap.add_argument("--qlora", action="store_true", help="also the 32B shape with --quantize-base nf4")
    ap.add_argument("--impls", default="areno,trl", help="areno, trl (TRL + PEFT runs on the 0.6b shape only)")
    ap.add_argument("--steps", type=int, default=2, help="steps per case; the first is not averaged")
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="areno KV budget (fraction or bytes)")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/lora_step.jsonl")
    args = ap.parse_args(argv)
    shapes = [x for x in args.shapes.split(",") if x and x != "none"]
    bad = [x for x in shapes if x not in ("0.6b", "8b")] + [x for x in args.impls.split(",") if x not in
                                                            ("areno", "trl")]
    if bad:
        ap.error(f"unknown --shapes/--impls value(s) {bad}")
    impls = args.impls.split(",")
    plan = [(sh, im) for sh in shapes for im in impls if im == "areno" or sh == "0.6b"]
    plan += [("32b-qlora", "areno")] if args.qlora and "areno" in impls else []
    env = {**env_info(), "command": " ".join(["python", "bench/lora_step.py", *(argv or sys.argv[1:])])}
    t_start = time.perf_counter()
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, impl in plan:
            if impl == "trl" and (why := missing_baseline()):
                print(f"note: TRL + PEFT baseline skipped: {why}", flush=True)
                continue
            emit(run_case(name, args, tmp, impl), records, args, env)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print_table(records, ["workload", "impl", "step_s", "rollout_s", "logprob_s", "train_s", "other_s", "peak_gib",
                          "reserved_gib", "build_s", "areno_speedup", "step_s_all", "error"])  # fmt: skip
    for r in records:
        if "areno_speedup" in r:
            print(f"G1-lora bar (areno >= 5x TRL + PEFT): {r['areno_speedup']:.1f}x")
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    return records


if __name__ == "__main__":
    main()
