"""The rollout engine on the hybrid Ling 3 (bailing_hybrid: KDA recurrent layers + MLA attention + sigmoid MoE):
per-sequence recurrent-state slots, chunked prefill carrying the state, n samples forked by a state copy, parity
with transformers' generate and with the model's own forward; routing capture (the experts each token used)."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block, state_bytes
from areno.models import load_model, load_tokenizer
from areno.models.attention_metadata import AttentionMetadata
from areno.testing import make_tiny_checkpoint
from tests.helpers.cpu_graph import CpuGraph
from tests.helpers.families import assert_preemption_keeps_tokens, assert_routes_match_forward

PROMPTS = ["hello world, 12 + 3 =", "tool call: {\"name\": \"add\"} and some longer text here"]


pytestmark = pytest.mark.skipif(not hasattr(transformers, "BailingHybridConfig"),  # the tiny checkpoint's config
                                reason=f"transformers {transformers.__version__} has no bailing_hybrid")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ling3"), family="bailing_hybrid", seed=1)
    model = load_model(path, dtype=torch.float32, device="cpu")
    return path, model, load_tokenizer(path)


def engine(model, tok, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_running", 8)
    return Engine(model, tok, EngineConfig(**kw))


def _forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) from one plain forward (no cache)."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model.logits(torch.tensor([ids], device=dev))[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:], device=dev)[:, None])[:, 0]


def test_greedy_n_samples_match_transformers_generate(hybrid):
    """Chunked prefill (7-token budget: prompts split over steps, the state carried between chunks), 3 samples per
    prompt forked from the first by a state copy: every sample equals transformers' generate."""
    path, model, tok = hybrid
    prompts = [tok.encode(p) for p in PROMPTS]
    e = engine(model, tok, max_batched_tokens=7)
    assert e.runner.states is not None and not e.blocks.prefix_caching  # prefix caching is off for hybrids
    out = e.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, n=3))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p, group in zip(prompts, out):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert [c.token_ids for c in group] == [ref] * 3
    assert sorted(e.blocks.free_state_slots) == list(range(8)) and e.blocks.num_free == e.blocks.num_blocks


def test_sampled_forks_and_multi_step_decode_match_the_forward(hybrid):
    """Sampled samples diverge after the fork; each one's log-probs equal a plain forward over its own tokens, so
    every fork started from the prompt's state and kept its own. Multi-step decode (k = 3 chained steps) and a
    cache small enough to preempt give the same tokens."""
    _, model, tok = hybrid
    prompts = [tok.encode(p) for p in PROMPTS]
    opts = SamplingParams(temperature=1.0, max_new_tokens=9, ignore_eos=True, n=3, seed=5)
    out = engine(model, tok).generate(prompts, opts)
    for group in out:
        assert len({tuple(c.token_ids) for c in group}) > 1
        for c in group:
            ref = _forward_logprobs(model, c.prompt_ids + c.token_ids)[len(c.prompt_ids) - 1:]
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-4, rtol=0)
    multi = engine(model, tok, decode_steps=3).generate(prompts, opts)
    assert [[c.token_ids for c in g] for g in multi] == [[c.token_ids for c in g] for g in out]
    ahead = engine(model, tok, decode_steps=3, lookahead=True)  # the next chain queued with the rows' state slots
    looked = ahead.generate(prompts, opts)
    assert ahead.chains.ahead is None and sorted(ahead.blocks.free_state_slots) == list(range(8))
    assert [[c.token_ids for c in g] for g in looked] == [[c.token_ids for c in g] for g in out]
    assert_preemption_keeps_tokens(model, tok, prompts, opts, engine, out)


def test_latent_mla_cache_equals_the_expanded_cache_and_fits_more_blocks(hybrid, monkeypatch):
    """The MLA layers' latent cache (``ARENO_MLA_CACHE=latent``: one ``r + d_rope`` row a token, absorbed decode)
    against K/V expanded per head (the default): same tokens and log-probs through chunked prefill over cached rows
    and forked samples; one budget holds as many more blocks as the rows are narrower."""
    path, _, tok = hybrid
    prompts = [tok.encode(p) for p in PROMPTS]
    opts = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, n=2, seed=11)
    monkeypatch.setenv("ARENO_MLA_CACHE", "latent")
    model = load_model(path, dtype=torch.float32, device="cpu")
    cfg = model.config
    assert model.kv_cache_layout == (1, (cfg.kv_lora_rank + cfg.qk_rope_head_dim,))
    latent_bytes = kv_bytes_per_block(model, 4, torch.float32)
    latent = engine(model, tok, max_batched_tokens=7, max_running=4, kv_cache_memory=40 * latent_bytes
                    + state_bytes(model, 4, torch.float32))
    assert latent.runner.kv_caches[1][0].shape == (40, 4, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    got = latent.generate(prompts, opts)
    monkeypatch.setenv("ARENO_MLA_CACHE", "expanded")
    expanded_model = load_model(path, dtype=torch.float32, device="cpu")
    assert expanded_model.kv_cache_layout == (2, (cfg.num_heads, expanded_model.kv_head_dim))
    expanded_bytes = kv_bytes_per_block(expanded_model, 4, torch.float32)
    assert expanded_bytes == latent_bytes * 2 * cfg.num_heads * expanded_model.kv_head_dim // (
        cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    ref = engine(expanded_model, tok, max_batched_tokens=7).generate(prompts, opts)
    for g1, g2 in zip(ref, got):
        for a, b in zip(g1, g2):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=2e-5, rtol=0)
    monkeypatch.setenv("ARENO_MLA_CACHE", "paged")
    with pytest.raises(ValueError, match="ARENO_MLA_CACHE"):
        load_model(path, dtype=torch.float32, device="cpu")


def test_routing_capture_equals_the_forwards_routing(hybrid):
    """``record_routing``: each completion carries, per token and MoE layer, the top-k experts the engine used;
    they equal those a plain forward over the same tokens picks (the last token is never fed: -1)."""
    _, model, tok = hybrid
    prompts = [tok.encode(p) for p in PROMPTS]
    e = engine(model, tok, max_batched_tokens=7, record_routing=True)
    out = e.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, n=2, seed=3))
    assert_routes_match_forward(model, [c for g in out for c in g])


def test_graph_inputs_give_the_eager_tokens_and_routes(hybrid, monkeypatch):
    """The CUDA-graph path's inputs replayed on the CPU (rows padded to a bucket with state slot -1, the static
    routing buffer), one step and three chained steps per graph: the tokens, log-probs and routes of eager steps."""
    _, model, tok = hybrid
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode("x")]
    opts = SamplingParams(temperature=1.0, max_new_tokens=7, ignore_eos=True, n=2, seed=9)
    ref = engine(model, tok, record_routing=True).generate(prompts, opts)
    for k in (1, 3):
        eng = engine(model, tok, decode_steps=k, record_routing=True)
        runner = eng.runner
        runner.use_graphs, runner.graph_buckets = True, [4, 8]

        def capture(bsz, k, width=0, rope_off=False, runner=runner):
            buf = runner._graph_buffers(bsz, width)
            graph = CpuGraph(runner, buf, k)
            runner.graphs[(bsz, k, width)] = (graph, buf, graph.out)

        monkeypatch.setattr(runner, "_capture", capture)
        got = eng.generate(prompts, opts)
        assert (8, k, 0) in runner.graphs  # 6 rows padded to 8
        for g1, g2 in zip(ref, got):
            for a, b in zip(g1, g2):
                assert a.token_ids == b.token_ids
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
                assert (a.routed_experts == b.routed_experts).all()


@pytest.mark.gpu
def test_cuda_graphs_with_state_slots_on_gpu(tmp_path):
    """On the GPU with CUDA graphs (Triton kernels; decode reads and writes the state pools at state_indices, padding
    rows at slot -1): in fp32 the sampled forks' log-probs and recorded routes equal a plain forward; in bf16, k = 8
    decode steps in one graph give the tokens, log-probs and routes of k one-step graphs."""
    path = make_tiny_checkpoint(tmp_path, family="bailing_hybrid", seed=4)
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode("more text " * i) for i in range(1, 4)]
    opts = [SamplingParams(temperature=1.0, max_new_tokens=12 + 5 * i, n=2, seed=i, ignore_eos=i % 2 == 0)
            for i in range(len(prompts))]
    model = load_model(path, dtype=torch.float32, device="cuda")
    eng = engine(model, tok, block_size=16, max_running=16, record_routing=True)
    out = eng.generate(prompts, opts)
    assert eng.runner.last_step_used_graph
    for c in [c for g in out for c in g]:
        ids = c.prompt_ids + c.token_ids
        ref = _forward_logprobs(model, ids)[len(c.prompt_ids) - 1:].cpu()
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-3, rtol=0)
        t = len(ids)
        cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        meta = AttentionMetadata(None, True, cu, cu, t, t)
        meta.routing_out = torch.full((model.num_moe_layers, t, model.moe_top_k), -1, dtype=torch.int32,
                                      device="cuda")
        with torch.no_grad():
            model(torch.tensor(ids, device="cuda"), torch.arange(t, device="cuda"), attn_metadata=meta)
        got = torch.from_numpy(c.routed_experts[:-1]).long().sort(-1).values
        want = meta.routing_out.permute(1, 0, 2)[:-1].long().cpu().sort(-1).values
        assert (got == want).float().mean() > 0.99  # fp32 kernels: a near-tie may flip a rare choice
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    outs = []
    for k in (1, 8):
        eng = engine(model, tok, block_size=16, max_running=16, decode_steps=k, record_routing=True)
        outs.append(eng.generate(prompts, opts))
        assert eng.runner.last_step_used_graph and any(key[1] == k for key in eng.runner.graphs)
        assert sorted(eng.blocks.free_state_slots) == list(range(16))
    for g1, g2 in zip(*outs):
        for a, b in zip(g1, g2):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
            assert (a.routed_experts == b.routed_experts).all()
