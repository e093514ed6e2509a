"""`areno eval`: K samples per prompt of each --dataset-path on areno's own engine (no HTTP), scored by the reward
file; prints a table of avg@K / pass@k / maj@K with bootstrap 95% intervals, writes the results JSON (metrics,
decoding settings, seeds, model / adapter / dataset hashes, throughput) and, with --output-dir, every sample."""

from __future__ import annotations

import json
import time
from pathlib import Path

from areno.config import ConfigError, SamplingParams
from areno.rl.eval_metrics import BOOTSTRAP_SAMPLES, metric_names
from areno.rl.eval_sets import PromptOptions, content_hash, load_eval_set, model_hash, tokenize_set
from areno.rl.evaluate import sample_set


def decoding(cfg) -> SamplingParams:
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=cfg.max_new_tokens, n=cfg.n_samples)


def build(cfg):
    """(engine, tokenizer) for --model-path, with --lora-path's adapter hooked in unmerged."""
    from areno.engine.build import build_engine, device_and_dtype
    from areno.models import load_model

    device, dtype = device_and_dtype(cfg.dtype)
    model = load_model(cfg.model_path, dtype=dtype, device=device)
    if cfg.lora_path:
        from areno.models.lora import LoraError, attach, read_peft_config

        try:
            attach(model, read_peft_config(cfg.lora_path)).load_weights(Path(cfg.lora_path).expanduser())
        except LoraError as e:
            raise ConfigError("--lora-path", str(e).removeprefix("--lora-path: ")) from e
    model.eval()
    return build_engine(cfg.model_path, model=model, max_running=cfg.max_running_prompts, seed=cfg.seed,
                        decode_steps=cfg.decode_steps)


def format_table(results, k: int) -> str:
    """One row per dataset: each metric as a percentage with its interval, ``71.2 [68.0,74.1]``."""
    names = metric_names(results[0].metrics) if results else []
    cells = [["dataset", "prompts", *names]]
    for r in results:
        cells.append([r.name, str(len(r.samples) // k),
                      *(f"{100 * r.metrics[n]:.1f} [{100 * r.metrics[n + '_lo']:.1f},{100 * r.metrics[n + '_hi']:.1f}]"
                        for n in names)])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def results_path(cfg) -> Path:
    if cfg.output_json:
        return Path(cfg.output_json)
    return Path(cfg.output_dir) / "results.json" if cfg.output_dir else Path("eval_results.json")


def run_eval(cfg) -> int:
    from tqdm import tqdm

    from areno.training.plugins import load_answer_extractor, load_reward_fn

    reward_fn, extract = load_reward_fn(cfg.reward_fn_path), load_answer_extractor(cfg.reward_fn_path)
    options = PromptOptions(cfg.prompt_field, cfg.answer_field, cfg.prompt_format, cfg.system_prompt)
    sets = [load_eval_set(name, path, options) for name, path in cfg.datasets]  # before the model
    engine, tokenizer = build(cfg)
    params = decoding(cfg)
    results, started = [], time.perf_counter()
    for data in sets:
        tokenize_set(data, tokenizer)
        t0, tokens = time.perf_counter(), [0]
        bar = tqdm(total=len(data.rows) * cfg.n_samples, unit="sample", desc=data.name, dynamic_ncols=True)

        def on_prompt(i, completions, bar=bar, t0=t0, tokens=tokens):
            tokens[0] += sum(len(c.token_ids) for c in completions)
            bar.update(len(completions))
            bar.set_postfix_str(f"{tokens[0] / max(1e-9, time.perf_counter() - t0):.0f} tok/s", refresh=False)

        try:
            result = sample_set(data, lambda ids, opts, cb: engine.generate(ids, opts, on_finished=cb),
                                tokenizer=tokenizer, reward_fn=reward_fn, extract=extract, params=params,
                                seed=cfg.seed, on_prompt=on_prompt)
        finally:
            bar.close()
        result.seconds = time.perf_counter() - t0
        results.append(result)
    elapsed = time.perf_counter() - started
    print(format_table(results, cfg.n_samples), flush=True)
    report = results_json(cfg, sets, results, elapsed)
    out = results_path(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if cfg.output_dir:
        with open(Path(cfg.output_dir) / "samples.jsonl", "w", encoding="utf-8") as f:
            for r in results:
                for s in r.samples:
                    f.write(json.dumps(s, default=str) + "\n")
    print(f"{report['generated_tokens']} tokens in {elapsed:.1f} s ({report['tokens_per_s']:.0f} tok/s, "
          f"{report['samples_per_s']:.1f} samples/s); results: {out}"
          + (f", samples: {Path(cfg.output_dir) / 'samples.jsonl'}" if cfg.output_dir else ""), flush=True)
    return 0


def results_json(cfg, sets, results, elapsed: float) -> dict:
    tokens = sum(r.tokens for r in results)
    samples = sum(len(r.samples) for r in results)
    return {
        "model": cfg.model_path, "model_sha256": model_hash(cfg.model_path),
        "lora_path": cfg.lora_path, "lora_sha256": content_hash(cfg.lora_path) if cfg.lora_path else None,
        "reward_fn_path": cfg.reward_fn_path, "reward_fn_sha256": content_hash(cfg.reward_fn_path),
        "decoding": {"n_samples": cfg.n_samples, "temperature": cfg.temperature, "top_p": cfg.top_p,
                     "top_k": cfg.top_k, "max_new_tokens": cfg.max_new_tokens, "dtype": cfg.dtype},
        "prompts": {"prompt_field": cfg.prompt_field, "answer_field": cfg.answer_field,
                    "prompt_format": cfg.prompt_format, "system_prompt": cfg.system_prompt},
        "seed": cfg.seed, "prompt_seeds": "sha256(seed/dataset/index) per prompt (areno.rl.evaluate.eval_seed)",
        "bootstrap": {"samples": BOOTSTRAP_SAMPLES, "level": 0.95, "seed": cfg.seed, "over": "prompts"},
        "datasets": {r.name: {"path": d.path, "sha256": d.sha256, "prompts": len(d.rows), "metrics": r.metrics,
                              "generated_tokens": r.tokens, "seconds": r.seconds}
                     for d, r in zip(sets, results)},
        "generated_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / max(elapsed, 1e-9),
        "samples_per_s": samples / max(elapsed, 1e-9),
    }
