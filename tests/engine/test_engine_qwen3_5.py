"""The rollout engine on Qwen3.5 (gated DeltaNet recurrent layers + gated attention; dense and MoE): greedy tokens
equal transformers' generate through chunked prefill and n forked samples, sampled forks' log-probs equal the plain
forward, preemption and multi-step decode change nothing, and the MoE's captured routes are the forward's."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block, state_bytes
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint
from tests.helpers.families import assert_routes_match_forward

PROMPTS = ["hello world, 12 + 3 =", "tool call: {\"name\": \"add\"} and some longer text here"]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(transformers, "Qwen3_5TextConfig"),
                                                   reason=f"transformers {transformers.__version__} has no qwen3_5")]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def hybrid(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=1)
    return path, load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)


def engine(model, tok, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_running", 8)
    return Engine(model, tok, EngineConfig(**kw))


def _forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model.logits(torch.tensor([ids]))[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_greedy_n_samples_match_transformers_generate(hybrid):
    """Chunked prefill (7-token budget: the conv and delta-rule states carried between chunks), 2 samples a prompt
    forked by a state copy: every sample equals transformers' generate."""
    path, model, tok = hybrid
    prompts = [tok.encode(p) for p in PROMPTS]
    e = engine(model, tok, max_batched_tokens=7)
    assert e.runner.states is not None and not e.blocks.prefix_caching
    out = e.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, n=2))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p, group in zip(prompts, out):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert [c.token_ids for c in group] == [ref] * 2
    assert sorted(e.blocks.free_state_slots) == list(range(8)) and e.blocks.num_free == e.blocks.num_blocks


def test_sampled_forks_preemption_and_routes(hybrid):
    """Sampled forks diverge; each one's log-probs equal a plain forward over its tokens; multi-step decode and a
    cache small enough to preempt give the same tokens; an MoE's recorded routes are the forward's."""
    _, model, tok = hybrid
    prompts = [tok.encode(p) for p in PROMPTS]
    opts = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, n=2, seed=5)
    out = engine(model, tok, record_routing=model.is_moe).generate(prompts, opts)
    for group in out:
        assert len({tuple(c.token_ids) for c in group}) > 1
        for c in group:
            ids = c.prompt_ids + c.token_ids
            ref = _forward_logprobs(model, ids)[len(c.prompt_ids) - 1:]
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-4, rtol=0)
        if model.is_moe:
            assert_routes_match_forward(model, group)
    multi = engine(model, tok, decode_steps=3).generate(prompts, opts)
    assert [[c.token_ids for c in g] for g in multi] == [[c.token_ids for c in g] for g in out]
    # lookahead (CUDA's default): the next chain queued before the host reads this one, the state slots with it
    ahead = engine(model, tok, decode_steps=2, lookahead=True)
    launch, queued = ahead.runner.launch_decode_steps, []
    ahead.runner.launch_decode_steps = lambda *a, **kw: (queued.append(kw.get("ids_from") is not None)
                                                         or launch(*a, **kw))
    looked = ahead.generate(prompts, opts)
    assert any(queued) and sorted(ahead.blocks.free_state_slots) == list(range(8))
    for g1, g2 in zip(out, looked):
        for a, b in zip(g1, g2):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    budget = 12 * kv_bytes_per_block(model, 4, torch.float32) + state_bytes(model, 6, torch.float32)
    small = engine(model, tok, max_running=6, kv_cache_memory=budget)
    tight = small.generate(prompts, opts)
    assert small.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in g] for g in tight] == [[c.token_ids for c in g] for g in out]


def test_decode_through_the_fused_gated_deltanet_kernel(hybrid, monkeypatch):
    """The Triton kernels (interpreted: decode through ``gdn_decode_step``, one kernel from the conv output to the
    recurrence's) give the native path's sampled tokens, and log-probs equal to a plain forward's."""
    _, model, tok = hybrid
    prompts = [tok.encode(p) for p in PROMPTS]
    opts = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True, n=2, seed=9)
    monkeypatch.setenv("ARENO_KERNELS", "native")
    ref = engine(model, tok).generate(prompts, opts)
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    out = engine(model, tok).generate(prompts, opts)
    assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in ref]
    for g, h in zip(out, ref):
        for c, d in zip(g, h):
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_cuda_graphs_with_state_slots_on_gpu(tmp_path, family):
    """On the GPU with CUDA graphs (Triton delta-rule step with the scalar gate, conv update at state_indices, padding
    rows at slot -1): fp32 sampled forks' log-probs equal a plain forward; in bf16, 8 decode steps in one graph give
    the tokens and log-probs of one-step graphs."""
    path = make_tiny_checkpoint(tmp_path, family=family, seed=4)
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode("more text " * i) for i in range(1, 4)]
    opts = [SamplingParams(temperature=1.0, max_new_tokens=12 + 5 * i, n=2, seed=i, ignore_eos=i % 2 == 0)
            for i in range(len(prompts))]
    model = load_model(path, dtype=torch.float32, device="cuda")
    eng = engine(model, tok, block_size=16, max_running=16)
    out = eng.generate(prompts, opts)
    assert eng.runner.last_step_used_graph
    for c in [c for g in out for c in g]:
        ids = c.prompt_ids + c.token_ids
        with torch.no_grad():
            logits = model.logits(torch.tensor([ids], device="cuda"))[0].float()
        ref = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref[len(c.prompt_ids) - 1:].cpu(), atol=2e-3, rtol=0)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    outs = []
    for k in (1, 8):
        eng = engine(model, tok, block_size=16, max_running=16, decode_steps=k)
        outs.append(eng.generate(prompts, opts))
        assert eng.runner.last_step_used_graph and sorted(eng.blocks.free_state_slots) == list(range(16))
    for g1, g2 in zip(*outs):
        for a, b in zip(g1, g2):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
