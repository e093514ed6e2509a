"""The rollout engine on DeepSeek-V3 (MLA only: paged latent or expanded cache, prefix caching) and Kimi-Linear (KDA
recurrent-state slots + NoPE MLA): greedy tokens equal transformers' generate through chunked prefill and n > 1 forks,
on both MLA caches; a cache small enough to preempt gives the same tokens; prefix hits (DeepSeek-V3) give the cold
tokens; routing capture equals the forward's routing."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint
from tests.helpers.families import assert_preemption_keeps_tokens, assert_routes_match_forward

PROMPTS = ["hello world, 12 + 3 =", "tool call: {\"name\": \"add\"} and some longer text here"]
CONFIG_CLASS = {"deepseek_v3": "DeepseekV3Config", "kimi_linear": "KimiLinearConfig"}


@pytest.fixture(scope="module", params=sorted(CONFIG_CLASS))
def family(request, tmp_path_factory):
    if not hasattr(transformers, CONFIG_CLASS[request.param]):
        pytest.skip(f"transformers {transformers.__version__} has no {request.param}")
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=1)
    model = load_model(path, dtype=torch.float32, device="cpu")
    yield request.param, path, model, load_tokenizer(path)
    model.set_mla_cache("expanded")


def engine(model, tok, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_running", 8)
    return Engine(model, tok, EngineConfig(**kw))


@pytest.mark.parametrize("cache", ["expanded", "latent"])
def test_greedy_n_samples_match_transformers_generate(family, cache):
    """Chunked prefill (a 7-token budget splits the prompts over steps), 3 samples per prompt: every sample equals
    transformers' generate, on either MLA cache; every block and state slot comes back."""
    name, path, model, tok = family
    model.set_mla_cache(cache)
    prompts = [tok.encode(p) for p in PROMPTS]
    e = engine(model, tok, max_batched_tokens=7)
    assert (e.runner.states is not None) == (name == "kimi_linear")
    out = e.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, n=3))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p, group in zip(prompts, out):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert [c.token_ids for c in group] == [ref] * 3, (name, cache)
    assert e.blocks.num_free == e.blocks.num_blocks


@pytest.mark.parametrize("cache", ["expanded", "latent"])
def test_preemption_gives_the_same_tokens(family, cache):
    _, _, model, tok = family
    model.set_mla_cache(cache)
    prompts = [tok.encode(p) for p in PROMPTS]
    opts = SamplingParams(temperature=1.0, max_new_tokens=9, ignore_eos=True, n=3, seed=5)
    ref = engine(model, tok).generate(prompts, opts)
    assert_preemption_keeps_tokens(model, tok, prompts, opts, engine, ref)


@pytest.mark.parametrize("cache", ["expanded", "latent"])
def test_prefix_hits_give_the_cold_tokens(family, cache):
    name, _, model, tok = family
    if name == "kimi_linear":
        pytest.skip("prefix caching is off for hybrid models (recurrent states are not cached per block)")
    model.set_mla_cache(cache)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    e = engine(model, tok)
    assert e.blocks.prefix_caching
    prefix = tok.encode(PROMPTS[1] * 2)
    e.generate([prefix + tok.encode(" one")], greedy)
    hits = e.blocks.prefix_hits
    warm = e.generate([prefix + tok.encode(" two")], greedy)[0][0]
    assert e.blocks.prefix_hits - hits >= (len(prefix) // 4) * 4
    cold = engine(model, tok, prefix_caching=False).generate([prefix + tok.encode(" two")], greedy)[0][0]
    assert warm.token_ids == cold.token_ids


def test_routing_capture_equals_the_forwards_routing(family):
    _, _, model, tok = family
    model.set_mla_cache("expanded")
    prompts = [tok.encode(p) for p in PROMPTS]
    e = engine(model, tok, max_batched_tokens=7, record_routing=True)
    out = e.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, n=2, seed=3))
    assert_routes_match_forward(model, [c for g in out for c in g])
