"""Where a decode step's time goes: host work (schedule, inputs) vs the GPU (graph replay) vs the token copy back.

    python bench/decode_profile.py            # H200: Qwen3-0.6B shape, 256 sequences, 128-token prompts
    python bench/decode_profile.py --smoke    # CPU: tiny shape (times meaningless)
    python bench/decode_profile.py --decode-steps 8   # k decode steps chained per scheduling round

With ``--decode-steps k`` one engine step runs k decode steps (one graph replay), so the times below are per
engine step and cover k tokens per sequence; ``*_per_token_ms`` divides them by the tokens each sequence got.

Runs R1's shape (256 prompts of 128 random tokens, ``--new`` tokens each, CUDA graphs on) twice (the first call
captures graphs and compiles) and on the second wraps the runner: per decode step it records the wall time of
``Engine.step``, the host time before the replay (scheduling, ``prepare``, input copies), the GPU time of the
forward (CUDA events around ``execute``) and the rest (token copy back, appends, stop checks). Prints the means
and appends one JSON line to bench/results/decode_profile.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from common import append_jsonl, env_info  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=1)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = models.checkpoint(args.smoke)
    from areno.config import SamplingParams
    from areno.engine.engine import Engine, EngineConfig
    from areno.models import load_model, load_tokenizer

    model = load_model(path, device=device)
    engine = Engine(model, load_tokenizer(path), EngineConfig(block_size=16, max_running=256, max_model_len=2064,
                                                              decode_steps=args.decode_steps),
                    eos_token_ids=[models.EOS_ID])
    vocab = model.config.vocab_size
    n, new = (8, 16) if args.smoke else (args.seqs, args.new)
    opts = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
    engine.generate(models.random_prompts(n, 128, vocab, seed=1), opts)  # capture + compile

    runner = engine.runner
    cuda = device.type == "cuda"
    rec = {"host": [], "gpu": [], "step": [], "post": []}
    per_step = []  # tokens each sequence got per decode engine step
    orig_execute = runner.execute
    marks = {}

    def timed_execute(inp):
        marks["pre"] = time.perf_counter()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        out = orig_execute(inp)  # ends with the .cpu() copies: synchronous
        marks["post0"] = time.perf_counter()
        if cuda:
            b.record()
            marks["events"] = (a, b)
        marks["decode"] = inp.is_decode
        return out

    runner.execute = timed_execute
    for p in models.random_prompts(n, 128, vocab, seed=2):
        engine.add_request(p, opts)
    steps = 0
    t_all = time.perf_counter()
    while engine.has_work():
        t0 = time.perf_counter()
        before = engine.scheduler.running[0].num_output if engine.scheduler.running else None
        rows = engine.step(args.decode_steps)
        t1 = time.perf_counter()
        steps += 1
        if marks.get("decode"):
            per_step.append(rows[0].num_output - before if before is not None and rows else 1)
            rec["step"].append(t1 - t0)
            rec["host"].append(marks["pre"] - t0)
            rec["post"].append(t1 - marks["post0"])
            if cuda:
                a, b = marks["events"]
                b.synchronize()
                rec["gpu"].append(a.elapsed_time(b) / 1e3)
    wall = time.perf_counter() - t_all
    runner.execute = orig_execute
    mean = {k: 1e3 * sum(v) / len(v) for k, v in rec.items() if v}
    out = {"bench": "decode_profile", "seqs": n, "new_tokens": new, "steps": steps, "wall_s": round(wall, 3),
           "tok_s": round(n * new / wall, 1), **{f"{k}_ms": round(v, 3) for k, v in mean.items()},
           "decode_steps": args.decode_steps, "tokens_per_step": round(sum(per_step) / max(1, len(per_step)), 3),
           **{f"{k}_per_token_ms": round(v * len(per_step) / max(1, sum(per_step)), 3) for k, v in mean.items()},
           "graph": runner.last_step_used_graph, **env_info()}
    print(out)
    if not args.no_save and not args.smoke:
        append_jsonl("decode_profile", [out])


if __name__ == "__main__":
    main()
