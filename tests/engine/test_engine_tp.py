"""The engine on a TP=2 gloo group (rank 0 schedules, rank 1 follows) gives TP=1's greedy and sampled tokens."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from areno.config import SamplingParams
from areno.distributed.launch import free_port
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint
from areno.testing.gemma4 import EVERY_FEATURE

OPTS = dict(temperature=0.0, max_new_tokens=8, ignore_eos=True)
# sampled, with penalties (their token-count slots filled and counted on every rank), a bias, min-p and min_tokens
SAMPLED = dict(temperature=1.0, max_new_tokens=6, seed=5, frequency_penalty=1.0, repetition_penalty=1.2, min_p=0.02,
               logit_bias={5: 1.5}, min_new_tokens=2)


# gemma4: KV-shared layers reading their producer's local blocks, PLE, k = v, the MoE block (experts replicated)
OVERRIDES = {"gemma4_text": EVERY_FEATURE}


def _prompts(tok):
    return [tok.encode(p) for p in ("hello there", "12 + 30 =", "x")]


def _worker(rank, path, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      ARENO_KERNELS="native")
    from areno.distributed import parallel

    parallel.init_distributed(backend="gloo", tp_size=2)
    model = load_model(path, dtype=torch.float32, device="cpu", tp_group=parallel.get_tp_group())
    tok = load_tokenizer(path)
    # multi-step decode on the TP ranks (the followers run rank 0's chained steps) vs one step at a time on one
    engine = Engine(model, tok, EngineConfig(block_size=4, max_running=8, max_batched_tokens=5, decode_steps=3))
    sampled = engine.generate(_prompts(tok), SamplingParams(**SAMPLED))
    greedy = engine.generate(_prompts(tok), SamplingParams(**OPTS))
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"greedy": [g[0].token_ids for g in greedy], "sampled": [g[0].token_ids for g in sampled]}, f)
    dist.barrier()  # neither rank tears gloo down while the other still uses it (an abort seen once under load)
    dist.destroy_process_group()


# hybrid: local heads, replicated latent cache; olmo3: a sliding window shorter than the prompts; gpt_oss: + sinks;
# deepseek_v3: MLA heads split, latent projections replicated; kimi_linear: KDA heads split, NoPE MLA;
# qwen3_5: the gated delta net's state slots split by heads
@pytest.mark.parametrize("family", ["qwen3", "bailing_hybrid", "olmo2", "olmo3", "gpt_oss", "deepseek_v3",
                                    "kimi_linear", "qwen3_5", "gemma4_text"])
def test_tp2_equals_tp1(tmp_path, family):

    needs = {"deepseek_v3": "DeepseekV3Config", "kimi_linear": "KimiLinearConfig",
             "qwen3_5": "Qwen3_5TextConfig"}.get(family)
    if needs and not hasattr(transformers, needs):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    path = make_tiny_checkpoint(tmp_path / "ckpt", family=family, seed=4, **OVERRIDES.get(family, {}))
    out = str(tmp_path / "res")
    mp.spawn(_worker, args=(path, free_port(), out), nprocs=2, join=True)
    r0, r1 = (json.load(open(f"{out}.{r}")) for r in (0, 1))
    assert r0 == r1  # every rank returns rank 0's results
    model = load_model(path, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(path)
    engine = Engine(model, tok, EngineConfig(block_size=4, max_running=8))
    ref = engine.generate(_prompts(tok), SamplingParams(**OPTS))
    assert r0["greedy"] == [g[0].token_ids for g in ref]
    sampled = engine.generate(_prompts(tok), SamplingParams(**SAMPLED))
    assert r0["sampled"] == [g[0].token_ids for g in sampled]
