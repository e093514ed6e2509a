"""Rollout-vs-trainer log-prob parity on the GPU: mean |engine log-prob - training-forward log-prob| for the
Qwen3-0.6B shape at two init scales (std 0.1, the benchmark checkpoint's, and 0.02, a real model's) and in
fp32/bf16, with CUDA-graph and eager decode. Separates kernel error from bf16 rounding of a random model.

    python bench/logprob_parity.py [--prompts 64 --new 128]
"""

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, print_table  # noqa: E402
from models import QWEN3_06B, random_prompts  # noqa: E402
from rollout import logprob_diff  # noqa: E402

from areno.config import SamplingParams  # noqa: E402
from areno.engine.engine import Engine, EngineConfig  # noqa: E402
from areno.models import load_model  # noqa: E402
from areno.testing import make_tiny_checkpoint  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for std in (0.1, 0.02):
        path = tempfile.mkdtemp(prefix=f"parity-{std}-")
        shape = dict(QWEN3_06B, num_hidden_layers=args.layers, initializer_range=std)
        make_tiny_checkpoint(path, "qwen3", seed=0, dtype=torch.bfloat16, **shape)
        for dtype in (torch.bfloat16, torch.float32):
            model = load_model(path, dtype=dtype, device=device)
            prompts = random_prompts(args.prompts, 64, shape["vocab_size"], seed=1)
            for eager in (False, True):
                engine = Engine(model, None, EngineConfig(max_running=args.prompts, max_model_len=64 + args.new + 16,
                                                          eager_decode=eager, kv_cache_memory=0.2),
                                eos_token_ids=[])
                out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new,
                                                               ignore_eos=True, seed=3))
                with torch.no_grad():
                    d = logprob_diff(model, out, device)
                rows.append({"init_std": std, "dtype": str(dtype).replace("torch.", ""), "graphs": not eager, **d})
                print(rows[-1], flush=True)
                del engine
                torch.cuda.empty_cache()
            del model
    print_table(rows, ["init_std", "dtype", "graphs", "logprob_diff_mean", "logprob_diff_max", "logprob_tokens"])
    append_jsonl("logprob_parity", rows)


if __name__ == "__main__":
    main()
