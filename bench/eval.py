"""`areno eval` throughput: K samples per prompt on areno's own engine, the whole command (load, sample, score).

    python bench/eval.py            # H200: Qwen3-0.6B shape, 500 prompts x 16 samples x 512 new tokens
                                    # (BENCH: >= 50k generated tok/s)
    python bench/eval.py --smoke    # CPU: tiny shape, 8 prompts x 4 samples x 8 tokens (times meaningless)

The prompts are random 128-token texts of the benchmark's word-level tokenizer, given as plain prompts; the answer
is a fixed word and the reward file checks for it (the random model answers nothing: the scores are ~0, the work is
the same). The engine runs the eval as a rollout: every prompt's K samples added at once, continuous batching up to
--max-running-prompts sequences, prefix-cache sharing of each prompt's K copies, CUDA-graph decode, counter-based
seeded sampling (one seed per prompt). Reported: generated tokens, the sampling time (from the results JSON, the
engine's own phase) and the whole command's wall time. Results go to bench/results/eval.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import models  # noqa: E402
from common import append_jsonl, env_info, print_table  # noqa: E402

REWARD = "def reward_fn(record):\n    return 1.0 if record.completion.strip() == record.answer else 0.0\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-running-prompts", type=int, default=1024)
    args = ap.parse_args()
    n = args.prompts or (8 if args.smoke else 500)
    k = args.samples or (4 if args.smoke else 16)
    new = args.max_new_tokens or (8 if args.smoke else 512)
    path = models.checkpoint(args.smoke)
    vocab = models.shape_of(args.smoke)["vocab_size"]
    from areno.cli import main as areno

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts = models.random_prompts(n, args.prompt_len, vocab, seed=0)
        (tmp / "set.jsonl").write_text("".join(json.dumps({"prompt": models.prompt_text(p), "answer": "t5"}) + "\n"
                                               for p in prompts))
        (tmp / "reward.py").write_text(REWARD)
        t0 = time.perf_counter()
        rc = areno(["eval", "--model-path", str(path), "--dataset-path", f"random={tmp / 'set.jsonl'}",
                    "--reward-fn-path", str(tmp / "reward.py"), "--n-samples", str(k), "--max-new-tokens", str(new),
                    "--temperature", "1.0", "--prompt-format", "plain", "--max-running-prompts",
                    str(args.max_running_prompts), "--output-json", str(tmp / "results.json")])
        wall = time.perf_counter() - t0
        if rc:
            return rc
        res = json.loads((tmp / "results.json").read_text())
    sampled = res["datasets"]["random"]
    row = {"prompts": n, "samples": k, "max_new_tokens": new, "max_running": args.max_running_prompts,
           "generated_tokens": res["generated_tokens"], "sample_s": sampled["seconds"],
           "tok_s": res["generated_tokens"] / sampled["seconds"], "wall_s": wall}
    print_table([row], list(row))
    print(f"areno eval: {row['tok_s']:.0f} generated tok/s over {row['sample_s']:.1f} s of sampling, "
          f"{wall:.1f} s in all (bar 50000 tok/s)")
    if not args.smoke:
        append_jsonl("eval", [row], env_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
