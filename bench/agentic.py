"""Agentic rollout throughput: many multi-turn sessions against the same tokens generated single-turn.

    python bench/agentic.py            # H200: Qwen3-0.6B shape, 256 sessions x 4 turns (BENCH: >= 60% of single-turn)
                                       # 2 warm-up passes of each path, then the mean ratio of 2 measured passes
    python bench/agentic.py --smoke    # CPU: tiny shape, 8 sessions x 3 turns (times meaningless)

Each session is a token-level agent (``ctx.generate``: the word-level benchmark tokenizer has no chat template): a
128-token prompt, then per turn up to 128 sampled tokens followed by a 32-token "tool result" appended as context,
4 turns, all sessions at once on the colocated engine (continuous batching through the agent sessions, the prefix
cache serving each earlier turn). The baseline generates, in the same process and engine, one turn of the same
total length per prompt (up to 4 x 128 new tokens) with ``Engine.generate``. Reported: sampled tokens per second of
each, and their ratio. Results go to bench/results/agentic.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import models  # noqa: E402
from common import append_jsonl, env_info, print_table  # noqa: E402


def sizes(smoke: bool) -> dict:
    if smoke:
        return dict(sessions=8, turns=3, prompt_len=16, turn_tokens=8, tool_tokens=4)
    return dict(sessions=256, turns=4, prompt_len=128, turn_tokens=128, tool_tokens=32)


def make_loop(path, s, smoke: bool, tmp: str):
    from areno.config import TrainConfig
    from areno.rl.loop import TrainLoop

    data = os.path.join(tmp, "prompts.jsonl")
    prompts = models.random_prompts(s["sessions"], s["prompt_len"], models.shape_of(smoke)["vocab_size"], seed=0)
    with open(data, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": models.prompt_text(p)}) + "\n")
    total = s["prompt_len"] + s["turns"] * (s["turn_tokens"] + s["tool_tokens"])
    cfg = TrainConfig(ckpt=str(path), dataset_path=data, reward_fn_path=os.path.join(BENCH, "grpo_reward.py"),
                      algo="grpo", batch_size=s["sessions"], n_samples=2, max_prompt_tokens=s["prompt_len"],
                      max_new_tokens=total - s["prompt_len"], temperature=1.0, dtype="float32" if smoke else "bfloat16",
                      seed=0, tensorboard=False, metrics_dir=os.path.join(tmp, "metrics"),
                      max_running_prompts=s["sessions"])
    loop = TrainLoop(cfg)
    loop.setup()
    return loop, prompts


def agentic(loop, prompts, s) -> tuple[int, float, dict]:
    """All sessions at once through the agent layer; returns (sampled tokens, seconds, stats)."""
    from areno.rl.agentic import AgentRollout
    from areno.training.data import Prompt

    rng = random.Random(1)
    vocab = len(loop.tokenizer)
    tools = {i: [rng.randrange(models.FIRST_TOKEN, vocab) for _ in range(s["tool_tokens"])]
             for i in range(len(prompts))}

    async def run_agent(ctx, batch):
        for item in batch.iter_samples():
            ids = list(prompts[item.prompt_index])
            for _ in range(s["turns"]):
                out = await ctx.generate(item, ids, max_tokens=s["turn_tokens"])
                ids = ids + out.token_ids + tools[item.prompt_index]
        return 0.0

    rollout = AgentRollout(loop.engine, run_agent, loop.tokenizer, loop.cfg)
    counts = dict(loop.engine.engine.step_counts)
    try:
        rows = [Prompt({"prompt": "x"}, i, list(p)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        out_rows, _, _, stats = rollout.run(rows, 1)
        seconds = time.perf_counter() - t0
    finally:
        rollout.close()
    sampled = sum(sum(r.loss_mask) for r in out_rows)
    now = loop.engine.engine.step_counts
    stats["single_steps"] = now["single"] - counts["single"]
    stats["chained_steps"] = now["chained"] - counts["chained"]
    return sampled, seconds, stats


def single_turn(loop, prompts, s) -> tuple[int, float]:
    from areno.config import SamplingParams

    options = SamplingParams(temperature=1.0, max_new_tokens=s["turns"] * s["turn_tokens"], n=1)
    loop.model.eval()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = loop.engine.engine.generate([list(p) for p in prompts], options)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    loop.model.train()
    return sum(len(g[0].token_ids) for g in out), seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured passes of each path first (CUDA-graph captures "
                    "of the batch sizes each path meets)")
    ap.add_argument("--repeats", type=int, default=2, help="measured passes of each path")
    args = ap.parse_args()
    s = sizes(args.smoke)
    path = models.checkpoint(args.smoke)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        loop, prompts = make_loop(path, s, args.smoke, tmp)
        try:
            for i in range(args.warmup + args.repeats):
                tokens_1, sec_1 = single_turn(loop, prompts, s)
                tokens_a, sec_a, stats = agentic(loop, prompts, s)
                rate_1, rate_a = tokens_1 / sec_1, tokens_a / sec_a
                rows.append({"repeat": i, "warmup": i < args.warmup, "sessions": s["sessions"], "turns": s["turns"],
                             "single_tokens": tokens_1, "single_s": sec_1, "single_tok_s": rate_1,
                             "agentic_tokens": tokens_a, "agentic_s": sec_a, "agentic_tok_s": rate_a,
                             "ratio": rate_a / rate_1, "prefill_tokens_per_turn": stats["agent_prefill_tokens_mean"],
                             "forks": stats["agent_forks"], "single_steps": stats["single_steps"],
                             "chained_steps": stats["chained_steps"]})
        finally:
            loop.close()
    print_table(rows, ["repeat", "warmup", "sessions", "turns", "single_tokens", "single_tok_s", "agentic_tokens",
                       "agentic_tok_s", "ratio", "prefill_tokens_per_turn", "forks", "single_steps",
                       "chained_steps"])
    measured = [r for r in rows if not r["warmup"]] or rows
    mean = sum(r["ratio"] for r in measured) / len(measured)
    print(f"agentic / single-turn, mean of {len(measured)} measured passes: {mean:.2f} (bar 0.60)")
    if not args.smoke:
        append_jsonl("agentic", measured, env_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
