"""Baseline: plain Hugging Face transformers on the BENCH.md shape: ``generate`` (R1, R3) and a train step (T1, T2).

    python bench/baselines/transformers_generate_train.py                     # R1 R3 T1 T2 on the GPU
    python bench/baselines/transformers_generate_train.py R1 --static-cache   # generate with a static (compiled) cache
    python bench/baselines/transformers_generate_train.py --smoke             # CPU: a tiny shape (times meaningless)

What a user gets without areno: a ``Qwen3ForCausalLM`` of the Qwen3-0.6B shape (``bench/models.py``'s
``QWEN3_06B``), random bf16 weights, sdpa attention. Generation samples at temperature 1 (top-p 1, top-k 0) and never
stops early (``min_new_tokens = max_new_tokens``); the first call is timed apart from the second (a static cache
compiles in the first). The train step is forward + next-token loss + backward + ``torch.optim.AdamW`` on the bf16
parameters, no activation checkpointing; one untimed step, then the mean of ``--steps``. Prints one JSON line per
measurement. ``bench/rollout.py`` and ``bench/train_step.py`` run the same baselines beside areno in their own run.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.baselines.common import run_parts  # noqa: E402
from bench.models import FIRST_TOKEN, PAD_ID, QWEN3_06B, SMOKE  # noqa: E402

# workload: (prompts, prompt tokens, new tokens) for generation, (rows, tokens per row) for training
GENERATE = {"R1": (256, 128, 256), "R3": (1, 128, 512)}
TRAIN = {"T1": (8, 1024), "T2": (4, 4096)}
SMOKE_GENERATE = {"R1": (4, 8, 8), "R3": (1, 8, 16)}
SMOKE_TRAIN = {"T1": (2, 32), "T2": (1, 64)}


def _wait(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def make_model(smoke: bool, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = {k: v for k, v in (SMOKE if smoke else QWEN3_06B).items() if k != "initializer_range"}
    config = Qwen3Config(rms_norm_eps=1e-6, attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(torch.float32 if smoke else torch.bfloat16), config


def measure_generate(model, config, device, workload, sizes, static_cache: bool) -> dict:
    prompts, prompt_len, new = sizes
    ids = torch.randint(FIRST_TOKEN, config.vocab_size, (prompts, prompt_len), device=device)
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=True,
                   temperature=1.0, top_p=1.0, top_k=0, pad_token_id=PAD_ID)  # fmt: skip
    if static_cache:
        options["cache_implementation"] = "static"
    model.eval()
    calls = []
    for _ in range(2):
        start = _wait(device)
        with torch.no_grad():
            out = model.generate(ids, **options)
        calls.append(_wait(device) - start)
    tokens = (out.shape[1] - prompt_len) * prompts
    impl = "transformers generate" + (", static cache" if static_cache else "")
    return {"workload": workload, "impl": impl, "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new,
            "first_call_s": calls[0], "wall_s": calls[1], "tok_s": tokens / calls[1]}  # fmt: skip


def measure_train(model, config, device, workload, sizes, steps: int) -> dict:
    rows, seqlen = sizes
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(FIRST_TOKEN, config.vocab_size, (rows, seqlen), device=device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()  # untimed: allocator and optimizer state warm
    start = _wait(device)
    for _ in range(steps):
        step()
    seconds = (_wait(device) - start) / steps
    rec = {"workload": workload, "impl": "transformers + torch AdamW", "batch": rows, "seqlen": seqlen,
           "step_ms": seconds * 1e3, "tok_s": rows * seqlen / seconds}  # fmt: skip
    if device == "cuda":
        rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return rec


def _options(ap) -> None:
    ap.add_argument("--static-cache", action="store_true", help="generate with cache_implementation='static'")
    ap.add_argument("--steps", type=int, default=3, help="timed train steps (after one untimed)")


def main(argv=None) -> None:
    model = {}  # built once, by the first part that runs

    def part(name):
        def run(args, device):
            import transformers

            if not model:
                model["m"], model["config"] = make_model(args.smoke, device)
            m, config = model["m"], model["config"]
            if name in GENERATE:
                sizes = (SMOKE_GENERATE if args.smoke else GENERATE)[name]
                rec = measure_generate(m, config, device, name, sizes, args.static_cache)
            else:
                rec = measure_train(m, config, device, name, (SMOKE_TRAIN if args.smoke else TRAIN)[name], args.steps)
            yield {**rec, "transformers": transformers.__version__}

        return run

    run_parts(__doc__, {name: part(name) for name in (*GENERATE, *TRAIN)}, argv, _options)


if __name__ == "__main__":
    main()
