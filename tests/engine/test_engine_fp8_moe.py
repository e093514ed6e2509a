"""FP8 rollout of routed experts (--rollout-dtype fp8, models/fp8_rollout.py + kernels/moe/fp8.py) in the engine, on
tiny Qwen3-MoE and DeepSeek-V3 checkpoints: the experts are quantised (E4M3 stacks, one scale per expert block), the
engine's greedy tokens and log-probs are those of an oracle model whose experts hold the dequantised FP8 values and
run, in float64, the same math the FP8 path does (x and h quantised per token and 128 columns: what ``fused_moe``'s
FP8 path computes, written here independently), and the log-probs stay near the unquantised model's.

The oracle's experts: weights = the dequantised copies (exactly what the codes and scales mean), each (token, slot)
pair's x quantised per 128 columns, g|u in float64 rounded to the model's dtype, h = act(g) u rounded, quantised
again, then h' W2'^T times the routing weight. Only summation order and float64 vs fp32 accumulation differ.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.kernels.fp8 import FP8, dequantize_act_fp8, dequantize_weight_fp8, quantize_act_fp8_native
from areno.models import fp8_rollout, load_model, load_tokenizer
from areno.models.layers import held_fp8
from areno.models.qwen3_moe import Experts
from areno.testing import make_tiny_checkpoint

PROMPTS = ["hello world, 12 + 3 =", "the cat", "1 2 3 4"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def ckpt(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=3)
    return path, load_tokenizer(path)


def _generate(model, tok):
    engine = Engine(model, tok, EngineConfig(block_size=4, max_running=8))
    return [g[0] for g in engine.generate([tok.encode(p) for p in PROMPTS], GREEDY)]


def _fake_quant64(t: torch.Tensor) -> torch.Tensor:
    return dequantize_act_fp8(*quantize_act_fp8_native(t)).double()


def _oracle_routed(experts, x, weights, ids, activation="silu"):
    """Float64 per expert over its pairs, the FP8 path's roundings (module docstring)."""
    act = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}[activation]
    w13, w2 = experts.w13.double(), experts.w2.double()
    xs, out = _fake_quant64(x), torch.zeros(x.shape, dtype=torch.float64)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        gate, up = (xs[tok] @ w13[e].T).to(x.dtype).chunk(2, dim=-1)
        h = _fake_quant64((act(gate) * up).to(x.dtype))
        out.index_add_(0, tok, (h @ w2[e].T) * weights[tok, slot, None].double())
    return out.to(x.dtype)


def _teacher_logprobs(model, ids, start):
    device = model.embed_tokens.weight.device
    with torch.no_grad():
        lp = torch.log_softmax(model.logits(torch.tensor([ids], device=device)).double()[0], -1)[start - 1 : -1]
    return lp.gather(-1, torch.tensor(ids[start:], device=device)[:, None])[:, 0].cpu()


def test_experts_are_quantised_and_run_the_fp8_math(ckpt):
    path, tok = ckpt
    model = load_model(path, dtype=torch.float32, device="cpu")
    ref = load_model(path, dtype=torch.float32, device="cpu")
    before, after = fp8_rollout.enable(model)
    experts = {n: m for n, m in fp8_rollout.fp8_modules(model).items() if isinstance(m, Experts)}
    assert experts and all(m.fp8_on for m in experts.values())
    e = next(iter(experts.values()))
    q13 = held_fp8(e, "w13")
    E, I2, H = e.w13.shape
    assert q13.qweight.dtype == FP8 and q13.qweight.shape == (E, I2, H) and q13.scale.shape == (E, 1, 1)
    n_params = sum(getattr(m, p).numel() for m in fp8_rollout.fp8_modules(model).values() for p in m.fp8_params)
    assert before == 4 * n_params and n_params < after < 1.05 * n_params  # fp32 here: a quarter, plus the scales
    bf16, fp8 = fp8_rollout.wire_bytes(model)
    assert bf16 == 2 * n_params and fp8 == after

    out = _generate(model, tok)
    # the oracle: the dense projections as FP8 as the engine runs them, the experts float64 on the dequantised copies
    fp8_rollout.enable(ref)
    for name, m in ref.named_modules():
        if isinstance(m, Experts):
            m.fp8_on = False
            with torch.no_grad():
                for p in m.fp8_params:
                    getattr(m, p).copy_(dequantize_weight_fp8(held_fp8(experts[name], p)))
            m.routed = functools.partial(_oracle_routed, m)
    want = _generate(ref, tok)
    for c, r in zip(out, want):
        assert c.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-4, rtol=0)


def test_logprobs_stay_near_the_unquantised_models(ckpt):
    path, tok = ckpt
    model = load_model(path, dtype=torch.float32, device="cpu")
    fp8_rollout.quantize(model)
    with fp8_rollout.fp8_forward(model):
        out = _generate(model, tok)
    diffs, kls = [], []
    for p, c in zip(PROMPTS, out):
        ids, start = tok.encode(p) + c.token_ids, len(tok.encode(p))
        with fp8_rollout.fp8_forward(model):
            mine = _teacher_logprobs(model, ids, start)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), mine, atol=1e-4)  # the engine ran FP8
        log_ratio = _teacher_logprobs(model, ids, start) - mine  # the fp32 trainer's forward minus the rollout's
        diffs.append(log_ratio.abs())
        kls.append(torch.expm1(log_ratio) - log_ratio)
    mean, kl = float(torch.cat(diffs).mean()), float(torch.cat(kls).mean())
    print(f"fp8 experts + projections vs fp32: mean |dlogp| {mean:.4f}, k3 KL {kl:.5f}")
    assert 0 < mean <= 0.25 and 0 <= kl <= 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fp8_experts_on_the_gpu_match_the_native_reference(family, tmp_path, monkeypatch):
    """bf16 on a GPU: the engine's Triton FP8 expert kernels (CUDA graphs included) give the native path's
    log-probs (weights at a real model's scale, std 0.02: at the tiny checkpoints' 0.1 bf16 rounding alone flips
    routes and moved log-probs past the bar, 0.052 and 0.123 on the H200)."""
    path = make_tiny_checkpoint(tmp_path / family, family=family, seed=3, initializer_range=0.02)
    model, tok = load_model(path, dtype=torch.bfloat16, device="cuda"), load_tokenizer(path)
    fp8_rollout.quantize(model)
    with fp8_rollout.fp8_forward(model):
        out = _generate(model, tok)
        monkeypatch.setenv("ARENO_KERNELS", "native")
        for p, c in zip(PROMPTS, out):
            ids, start = tok.encode(p) + c.token_ids, len(tok.encode(p))
            ref = _teacher_logprobs(model, ids, start)
            assert (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().mean() < 0.05
