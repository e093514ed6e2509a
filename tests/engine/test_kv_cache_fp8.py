"""The engine's FP8 paged KV cache (--kv-cache-dtype fp8; engine/kv_cache.py, model_runner.py): its layout and the
token capacity a budget buys, teacher-forced log-probs and greedy tokens near the model's-dtype cache, chunked
prefill and prefix hits reading the quantised cache, block copies carrying their scales, preemption, the Triton path
(interpreted) equal to the native one, Gemma 4's own layout, refusals.

The bound: each cached K/V element is within 2^-4 of itself relatively (E4M3, per-token-per-head scale; 2^-10 s
below the smallest normal), so every attention score and output moves by a few percent of its magnitude at most; on
this random tiny model (D = 16; nearly flat next-token distributions, the worst case for greedy agreement) the
sampled tokens' mean |log p_fp8 - log p| measured 0.020 (MEAN_BOUND 0.06) and greedy agreed on 33 of 40 tokens.
"""

import pytest
import torch

from areno.config import ConfigError, SamplingParams, ServeConfig
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block
from areno.kernels.fp8 import FP8
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint

PROMPTS = ["hello world, 12 + 3 =", "the cat", "tool call: {\"name\": \"add\"} and some longer text here", "1 2 3"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
MEAN_BOUND = 0.06

pytestmark = pytest.mark.slow  # 5-19 s a test on 2 shared cores (engine generate on CPU; one under the interpreter)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("kvfp8"), family="qwen3", seed=2)
    return load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)


def engine(model, tok, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_running", 8)
    return Engine(model, tok, EngineConfig(**kw))


def teacher_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    """float64 log-probs of ``ids[start:]`` given their prefixes (one plain forward, no cache)."""
    with torch.no_grad():
        logits = model.logits(torch.tensor([ids], device=model.embed_tokens.weight.device)).double()[0].cpu()
    lp = torch.log_softmax(logits, -1)[start - 1 : -1]
    return lp.gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]


def mean_logprob_diff(model, completions) -> float:
    """Mean |engine log-prob - exact forward's| over every sampled token of ``completions``."""
    diffs = [(torch.tensor(c.logprobs, dtype=torch.float64)
              - teacher_logprobs(model, c.prompt_ids + c.token_ids, len(c.prompt_ids))).abs()
             for group in completions for c in group]  # fmt: skip
    return torch.cat(diffs).mean().item()


def test_layout_and_token_capacity(qwen3):
    """E4M3 K/V with fp32 scales [L, 2, blocks, block_size, Hkv] beside them; the same budget buys the tokens the
    bytes say: 2 Hkv (D + 4) bytes a layer-token against 2 Hkv D 2 in bf16 (1.6x at this D = 16, 1.94x at D = 128)."""
    model, tok = qwen3
    auto_bytes = kv_bytes_per_block(model, 4, torch.float32)
    budget = 40 * auto_bytes
    auto = engine(model, tok, kv_cache_memory=budget)
    fp8 = engine(model, tok, kv_cache_memory=budget, kv_cache_dtype="fp8")
    r = fp8.runner
    hkv, d = model.num_kv_heads_local, model.kv_head_dim
    assert r.kv_cache.dtype == FP8 and r.kv_scales.dtype == torch.float32
    assert r.kv_scales.shape == r.kv_cache.shape[:-1] and r.kv_scales.shape[-1] == hkv
    assert len(r.kv_caches[0]) == 4 and r.kv_caches[0][2].is_contiguous()
    per_block = kv_bytes_per_block(model, 4, FP8)
    assert per_block == model.num_layers * 2 * 4 * hkv * (d + 4)
    assert r.kv_cache.nbytes + r.kv_scales.nbytes == fp8.blocks.num_blocks * per_block <= budget
    assert auto.blocks.num_blocks == 40 and fp8.blocks.num_blocks == budget // per_block
    bf16_blocks = budget // kv_bytes_per_block(model, 4, torch.bfloat16)
    assert fp8.blocks.num_blocks / bf16_blocks == pytest.approx(2 * d / (d + 4), rel=0.05)


def test_logprobs_and_greedy_near_the_exact_forward(qwen3):
    """Chunked prefill (a 5-token budget: later chunks read the quantised cache), multi-step decode: each sampled
    token's log-prob is within MEAN_BOUND of the exact forward's on average, and greedy agrees with the fp32 cache
    on most tokens (a random tiny model: one flip changes the rest of a completion)."""
    model, tok = qwen3
    prompts = [tok.encode(p) for p in PROMPTS]
    ref = engine(model, tok).generate(prompts, GREEDY)
    out = engine(model, tok, kv_cache_dtype="fp8", max_batched_tokens=5, decode_steps=3).generate(prompts, GREEDY)
    assert mean_logprob_diff(model, ref) < 1e-4  # the fp32 cache is the exact forward
    assert mean_logprob_diff(model, out) < MEAN_BOUND
    same = sum(a == b for g, h in zip(ref, out) for a, b in zip(g[0].token_ids, h[0].token_ids))
    assert same >= 0.6 * sum(len(g[0].token_ids) for g in ref)
    sampled = engine(model, tok, kv_cache_dtype="fp8").generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=3))
    assert mean_logprob_diff(model, sampled) < MEAN_BOUND


def test_block_copies_carry_their_scales(qwen3):
    """A copied block (a fork's partly filled last block) holds the source's E4M3 bytes and scales."""
    model, tok = qwen3
    r = engine(model, tok, kv_cache_dtype="fp8").runner
    r.kv_cache.view(torch.uint8)[:, :, 1].random_(0, 120)
    r.kv_scales[:, :, 1].uniform_(0.5, 2.0)
    r._copy_blocks([(1, 3)])
    assert torch.equal(r.kv_cache.view(torch.uint8)[:, :, 3], r.kv_cache.view(torch.uint8)[:, :, 1])
    assert torch.equal(r.kv_scales[:, :, 3], r.kv_scales[:, :, 1])
    assert r.kv_scales[:, :, 2].abs().sum() == 0


def test_forks_prefix_hits_and_preemption(qwen3):
    """n greedy samples of a prompt (its last block copied per fork) are identical; a second request reuses the
    first one's cached, quantised prefix blocks; a cache small enough to preempt still gives tokens whose log-probs
    are within the bound, and every block comes back."""
    model, tok = qwen3
    e = engine(model, tok, kv_cache_dtype="fp8")
    prompt = tok.encode(PROMPTS[2])
    group = e.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, n=3))[0]
    assert len({tuple(c.token_ids) for c in group}) == 1
    prefix = tok.encode(PROMPTS[3] * 3)
    e.generate([prefix + tok.encode(" one")], GREEDY)
    hits = e.blocks.prefix_hits
    second = e.generate([prefix + tok.encode(" two")], GREEDY)
    assert e.blocks.prefix_hits - hits >= (len(prefix) // 4) * 4
    assert mean_logprob_diff(model, second) < MEAN_BOUND
    small = engine(model, tok, kv_cache_dtype="fp8", kv_cache_memory=36 * kv_bytes_per_block(model, 4, FP8))
    out = small.generate([tok.encode(p) for p in PROMPTS] * 2,
                         SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    assert small.scheduler.num_preemptions > 0
    assert mean_logprob_diff(model, out) < MEAN_BOUND
    assert small.blocks.num_free == small.blocks.num_blocks


def test_triton_path_equals_the_native_one(qwen3, monkeypatch):
    """The GPU's path, interpreted: qk_norm_rope then the quantising store_kvcache kernel (the fused qkv_prologue
    writes only the model's dtype), and the dequantising paged-attention kernel in decode and in chunked prefill over
    cached blocks, give the native path's tokens and log-probs (fp32)."""
    model, tok = qwen3
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    opts = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    native = engine(model, tok, kv_cache_dtype="fp8", max_batched_tokens=8).generate(prompts, opts)
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    triton = engine(model, tok, kv_cache_dtype="fp8", max_batched_tokens=8).generate(prompts, opts)
    for a, b in zip(native, triton):
        assert a[0].token_ids == b[0].token_ids
        torch.testing.assert_close(torch.tensor(b[0].logprobs), torch.tensor(a[0].logprobs), atol=1e-5, rtol=0)


def test_gemma4_flat_rows_with_per_layer_heads(tmp_path):
    """Gemma 4 (its own flat K/V rows, per-layer Hkv and head dims, KV-shared layers, sliding groups): the scales are
    ``[.., kv_scale_heads]`` rows each layer views the first Hkv of; log-probs within the bound, blocks come back."""
    path = make_tiny_checkpoint(tmp_path / "g4", family="gemma4_text", seed=1)
    model, tok = load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)
    e = engine(model, tok, kv_cache_dtype="fp8", max_batched_tokens=6)
    assert e.runner.kv_scales.shape[-1] == model.kv_scale_heads
    out = e.generate([tok.encode(p) for p in PROMPTS[2:]], GREEDY)
    assert mean_logprob_diff(model, out) < MEAN_BOUND  # measured 0.03
    assert e.blocks.num_free == e.blocks.num_blocks


def test_refusals(tmp_path):
    """An MLA model (its latent cache; DeepSeek-V3 here) is refused naming the flag; a bad value too."""
    import transformers

    with pytest.raises(ConfigError, match="--kv-cache-dtype"):
        ServeConfig(model_path="x", kv_cache_dtype="fp16")
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip(f"transformers {transformers.__version__} has no deepseek_v3")
    path = make_tiny_checkpoint(tmp_path / "ds", family="deepseek_v3", seed=1)
    model, tok = load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 with an MLA model"):
        engine(model, tok, kv_cache_dtype="fp8")
    assert engine(model, tok).runner.kv_scales is None  # auto: unchanged


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_fp8_cache_with_graphs(tmp_path):
    """bf16 on the GPU, CUDA graphs and the Triton kernels: the fp8 cache's warm-up compiles the dequantising
    variants, graphs replay, and the sampled tokens' log-probs stay near the bf16 cache's engine."""
    path = make_tiny_checkpoint(tmp_path / "q3", family="qwen3", seed=2)
    model, tok = load_model(path, dtype=torch.bfloat16, device="cuda"), load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    bf16 = engine(model, tok, kv_cache_memory=1 << 20)  # 1,024 bf16 blocks: the budget binds, not the cap (4,104)
    fp8 = engine(model, tok, kv_cache_memory=1 << 20, kv_cache_dtype="fp8", decode_steps=4)
    # the fp32 scale of each (token, KV head) row costs a tiny head (here 16 wide) a fifth of its bytes: 1.6x the blocks
    ratio = kv_bytes_per_block(model, 4, torch.bfloat16) / kv_bytes_per_block(model, 4, FP8)
    assert ratio > 1.5 and fp8.blocks.num_blocks >= int(0.99 * ratio * bf16.blocks.num_blocks)
    assert fp8.runner.warm_kernels() > 0
    ref = bf16.generate(prompts, GREEDY)
    out = fp8.generate(prompts, GREEDY)
    assert fp8.runner.last_step_used_graph
    assert mean_logprob_diff(model, out) < mean_logprob_diff(model, ref) + MEAN_BOUND  # teacher-forced, bf16 forward
