"""The rollout engine on Gemma 4 (KV-shared layers reading their producer's paged blocks, per-layer head dims in one
flat cache row, PLE, the MoE block, soft-capped sampling): greedy tokens equal transformers' generate through chunked
prefill, n > 1, prefix hits and preemption; sampled log-probs equal the model's soft-capped forward; routing capture
equals the forward's routing."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint
from areno.testing.gemma4 import MOE, SHARED_PLE
from tests.helpers.families import assert_routes_match_forward

pytestmark = pytest.mark.skipif(not hasattr(transformers, "Gemma4TextConfig"),
                                reason=f"transformers {transformers.__version__} has no Gemma 4")

PROMPTS = ["hello world, 12 + 3 =", "tool call: {\"name\": \"add\"} and some longer text here"]
VARIANTS = {
    "shared_ple": SHARED_PLE,
    "moe": MOE,
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gemma4(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family="gemma4_text", seed=1,
                                **VARIANTS[request.param])
    return path, load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)


def engine(model, tok, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_running", 8)
    return Engine(model, tok, EngineConfig(**kw))


def test_greedy_n_samples_prefix_hits_and_preemption_match_transformers_generate(gemma4):
    path, model, tok = gemma4
    prompts = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, n=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    e = engine(model, tok, max_batched_tokens=7)  # chunked prefill: the prompts split over steps
    # KV-shared layers own no blocks: they read their source layer's (in its KV-cache group)
    assert [i for i, c in enumerate(e.runner.kv_caches) if c is not None] == model.kv_cache_layers
    out = e.generate(prompts, greedy)
    assert [[c.token_ids for c in g] for g in out] == [[r, r] for r in refs]
    again = e.generate(prompts, greedy)  # the prompts' full blocks come from the prefix cache
    assert e.blocks.prefix_hits > 0
    assert [[c.token_ids for c in g] for g in again] == [[r, r] for r in refs]
    small = engine(model, tok, max_running=4, kv_cache_memory=24 * kv_bytes_per_block(model, 4, torch.float32))
    tight = small.generate(prompts, greedy)
    assert small.scheduler.num_preemptions > 0 and small.blocks.num_free == small.blocks.num_blocks
    assert [[c.token_ids for c in g] for g in tight] == [[r, r] for r in refs]


def test_sampled_logprobs_equal_the_soft_capped_forward(gemma4):
    _, model, tok = gemma4
    prompts = [tok.encode(p) for p in PROMPTS]
    out = engine(model, tok).generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=6, ignore_eos=True,
                                                              n=2, seed=3))
    for c in [c for g in out for c in g]:
        ids = c.prompt_ids + c.token_ids
        with torch.no_grad():
            logits = model.logits(torch.tensor([ids]))[0, len(c.prompt_ids) - 1 : -1].double() / 0.8
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


def test_routing_capture_equals_the_forwards_routing(gemma4):
    _, model, tok = gemma4
    if not model.is_moe:
        pytest.skip("dense variant")
    prompts = [tok.encode(p) for p in PROMPTS]
    e = engine(model, tok, max_batched_tokens=7, record_routing=True)
    out = e.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, n=2, seed=3))
    assert_routes_match_forward(model, [c for g in out for c in g])
