"""FP8 rollout in the engine (models/fp8_rollout.py, --rollout-dtype fp8) on a tiny checkpoint whose widths are
multiples of 128: which modules are quantised, every FP8 GEMM inside the quantisation bound of the exact product,
the engine's log-probs are the FP8 model's and stay near the fp32 model's, greedy mostly agrees, serving refusals.

The bound: E4M3 keeps 3 mantissa bits, so a rounded weight or activation is within 2^-4 of itself relatively (above
its block's smallest normal, 2^-6 s; within 2^-10 s absolutely below it, s the block's scale). A product of two
rounded operands is then within (2 * 2^-4 + 2^-8) |x w| (+ the absolute terms), and a dot product within that of
sum |x_k| |w_k|: what ``test_every_fp8_gemm_is_inside_the_rounding_bound`` checks on every projection, at every step
of a real generate. End to end the errors add up over the layers; on this random tiny model (nearly flat next-token
distributions, the worst case for greedy agreement) the mean |log p_fp8 - log p_fp32| over the sampled tokens is
about 0.1 and the k3 KL about 0.01 (bf16 weights and activations vs fp32: 0.014).
"""

import pytest
import torch

from areno.config import ConfigError, SamplingParams
from areno.engine.build import build_engine
from areno.engine.engine import Engine, EngineConfig
from areno.kernels.fp8 import BLOCK, FP8, quantize_weight_fp8
from areno.models import fp8_rollout, load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint

WIDTHS = dict(hidden_size=128, intermediate_size=256, head_dim=32)  # q 128, k and v 64 rows each: qkv 256
PROMPTS = ["hello world, 12 + 3 =", "the cat", "a longer prompt about tools", "1 2 3 4", "x"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
MEAN_BOUND, KL_BOUND = 0.25, 0.05  # measured about 0.1 and 0.01 (module docstring)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("fp8"), family="qwen3", seed=2, **WIDTHS)
    return path, load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)


def _engine(model, tok):
    return Engine(model, tok, EngineConfig(block_size=4, max_running=8))


def _teacher_logprobs(model, ids: list[int], start: int, fp8: bool) -> torch.Tensor:
    """fp64 log-probs of ``ids[start:]`` given their prefixes (one plain forward)."""
    with torch.no_grad(), fp8_rollout.fp8_forward(model, fp8):
        logits = model.logits(torch.tensor([ids], device=model.embed_tokens.weight.device)).double()[0]
    lp = torch.log_softmax(logits, -1)[start - 1 : -1]
    return lp.gather(-1, torch.tensor(ids[start:], device=lp.device)[:, None])[:, 0].cpu()


def test_the_projections_are_quantised_and_the_rest_is_not(tiny):
    _, model, _ = tiny
    before, after = fp8_rollout.quantize(model)
    names = fp8_rollout.fp8_modules(model)
    assert sorted({n.rsplit(".", 1)[1] for n in names}) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert len(names) == 4 * model.num_layers and "lm_head" not in names
    n_k = sum(m.weight.numel() for m in names.values())
    blocks = sum(-(-m.weight.shape[0] // BLOCK) * -(-m.weight.shape[1] // BLOCK) for m in names.values())
    assert (before, after) == (4 * n_k, n_k + 4 * blocks)  # fp32 weights here: a quarter (bf16's half) + scales
    m = names["layers.0.mlp.down_proj"]
    assert m.fp8_qweight.dtype == FP8 and m.fp8_scale.shape == (1, 2)
    q = quantize_weight_fp8(m.weight)
    assert torch.equal(m.fp8_qweight.view(torch.uint8), q.qweight.view(torch.uint8))
    assert all(not m.fp8_on for m in names.values())  # the model's own forward stays full precision


def test_every_fp8_gemm_is_inside_the_rounding_bound(tiny):
    _, model, tok = tiny
    fp8_rollout.quantize(model)
    worst = []

    def check(module, args, out):
        x = args[0].double().reshape(-1, args[0].shape[-1])
        w = module.weight.double()
        exact = x @ w.T
        s_x = x.abs().view(x.shape[0], -1, BLOCK).amax(-1).repeat_interleave(BLOCK, 1) / 448
        s_w = module.fp8_scale.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        bound = (2**-3 + 2**-8) * (x.abs() @ w.abs().T) + 2**-9 * (s_x @ w.abs().T + x.abs() @ s_w.T) + 1e-6
        err = (out.double().reshape(exact.shape) - exact).abs()
        worst.append(float((err / bound).max()))

    hooks = [m.register_forward_hook(check) for m in fp8_rollout.fp8_modules(model).values()]
    try:
        with fp8_rollout.fp8_forward(model):
            _engine(model, tok).generate([tok.encode(p) for p in PROMPTS[:2]], GREEDY)
    finally:
        for h in hooks:
            h.remove()
    print(f"largest error / bound over every fp8 GEMM: {max(worst):.3f}")
    assert worst and max(worst) <= 1.0, max(worst)
    assert max(worst) > 0.01  # the copies really ran (an fp32 forward would be far inside the bound)


def test_engine_logprobs_are_the_fp8_models_and_near_the_fp32_ones(tiny):
    _, model, tok = tiny
    fp8_rollout.quantize(model)
    prompts = [tok.encode(p) for p in PROMPTS]
    with fp8_rollout.fp8_forward(model):
        fp8_out = [g[0] for g in _engine(model, tok).generate(prompts, GREEDY)]
    ref_out = [g[0] for g in _engine(model, tok).generate(prompts, GREEDY)]
    diffs, kls, same, first, engine_vs_fp8 = [], [], 0, 0, []
    for p, c, r in zip(prompts, fp8_out, ref_out):
        ids = p + c.token_ids
        mine = _teacher_logprobs(model, ids, len(p), fp8=True)
        # the engine ran FP8: its log-probs are the FP8 forward's, up to an activation's E4M3 rounding flipped by
        # the paged path's last-bit differences from the full forward (a 2^-4 step of one element: <= ~0.02 here)
        engine_vs_fp8.append((torch.tensor(c.logprobs, dtype=torch.float64) - mine).abs())
        log_ratio = _teacher_logprobs(model, ids, len(p), fp8=False) - mine  # trainer (fp32) minus rollout (fp8)
        diffs.append(log_ratio.abs())
        kls.append(torch.expm1(log_ratio) - log_ratio)  # k3, as rl/corrections.mismatch_sums
        same += sum(a == b for a, b in zip(c.token_ids, r.token_ids))
        first += c.token_ids[0] == r.token_ids[0]
    mean, kl = float(torch.cat(diffs).mean()), float(torch.cat(kls).mean())
    print(f"fp8 vs fp32: mean |dlogp| {mean:.4f}, k3 KL {kl:.4f}, greedy tokens equal {same}/{len(prompts) * 8}, "
          f"first tokens equal {first}/{len(prompts)}")
    assert 0 < mean <= MEAN_BOUND and 0 <= kl <= KL_BOUND
    near = torch.cat(engine_vs_fp8)
    assert float(near.max()) <= 0.05 and float(near.mean()) <= 0.1 * mean  # far nearer FP8's than fp32's
    assert first >= len(prompts) // 2 + 1  # greedy mostly agrees where it has not diverged yet


@pytest.mark.parametrize("family", ["qwen3_moe", "bailing_hybrid"])
def test_other_families_decode_through_the_copies(family, tmp_path):
    """MoE (the routed experts quantised too: tests/engine/test_engine_fp8_moe.py) and a hybrid with MLA and linear
    attention."""
    path = make_tiny_checkpoint(tmp_path / family, family=family, seed=1)
    model, tok = load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)
    prompts = [tok.encode("hello there"), tok.encode("a")]
    ref = [g[0] for g in _engine(model, tok).generate(prompts, GREEDY)]
    fp8_rollout.enable(model)
    assert any(n.endswith(".experts") for n in fp8_rollout.fp8_modules(model))
    out = [g[0] for g in _engine(model, tok).generate(prompts, GREEDY)]
    first = torch.tensor([c.logprobs[0] for c in out]) - torch.tensor([c.logprobs[0] for c in ref])
    assert all(len(c.token_ids) == 8 for c in out) and 0 < first.abs().max() < 0.5


def test_norms_and_swiglu_hand_their_quantised_output_to_the_projections(tiny, monkeypatch):
    """Under FP8 rollout on cuBLAS's path the layers' input / post-attention norms and the SwiGLU quantise their
    own output (rms_norm_fp8, silu_and_mul_fp8) and qkv, gate_up and down multiply it without an activation kernel:
    the logits are bit-identical to quantising in each projection. cuBLAS's GEMM is emulated on the CPU (dequantise
    both operands, fp32 matmul) and the fused path allowed for fp32 here (on a GPU: bf16 with cuBLAS's GEMM)."""
    from areno.kernels import fp8
    from areno.models import base, layers

    _, model, _ = tiny
    fp8_rollout.quantize(model)
    given = []

    def emulated(xq, xs, q, out_dtype=torch.bfloat16, rows=None):
        return fp8.fp8_matmul_native(xq, xs.contiguous(), q).to(out_dtype)[:rows]

    real_linear = fp8.fp8_linear

    def spy(x, q, bias=None, *, act=None, _gemm="auto"):
        given.append(act is not None)
        return real_linear(x, q, bias, act=act, _gemm=_gemm)

    monkeypatch.setattr(fp8, "cublas_fp8_applies", lambda x, q: True)
    monkeypatch.setattr(fp8, "use_triton", lambda *a, **k: True)  # fp8_linear's cuBLAS branch (activation kernel
    monkeypatch.setattr(fp8, "fp8_matmul_cublas", emulated)  # interpreted): down_proj reads the SwiGLU's act alone,
    # whose values are NaN here (never written on a GPU), so a reader of them would show in the logits
    monkeypatch.setattr(layers, "fp8_linear", spy)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7, 8]])

    def logits(fused: bool):
        allow = (lambda y, k=None: not torch.is_grad_enabled() and (y.shape[-1] if k is None else k) % BLOCK == 0) \
            if fused else (lambda y, k=None: False)  # fmt: skip
        monkeypatch.setattr(layers, "fused_act_applies", allow)
        monkeypatch.setattr(base, "fused_act_applies", allow)
        given.clear()
        with torch.no_grad(), fp8_rollout.fp8_forward(model):
            out = model.logits(ids)
        return out, list(given)

    fused, fused_given = logits(True)
    plain, plain_given = logits(False)
    assert torch.equal(fused, plain)
    assert len(fused_given) == 4 * model.num_layers and not any(plain_given)
    assert sum(fused_given) == 3 * model.num_layers  # qkv, gate_up, down; o_proj's input is attention's output
    assert not any(n.fp8_act for n in fp8_rollout.act_norms(model))  # off again after the FP8 forward
    assert len(fp8_rollout.act_norms(model)) == 2 * model.num_layers  # not the final norm: lm_head reads it in bf16


def test_serving_fp8_and_its_refusals(tiny):
    path, _, tok = tiny
    engine, _ = build_engine(str(path), dtype="float32", device="cpu", rollout_dtype="fp8", max_running=4)
    mods = fp8_rollout.fp8_modules(engine.model)
    assert mods and all(m.fp8_on for m in mods.values())
    out = engine.generate([tok.encode("hello")], GREEDY)[0][0]
    assert len(out.token_ids) == 8
    from areno.config.serve import ServeConfig

    for kw, words in [({"max_loras": 2}, "LoRA adapters"), ({"rollout_dtype": "fp4"}, "")]:
        with pytest.raises(ConfigError, match=f"^--rollout-dtype.*{words}"):
            ServeConfig(model_path=str(path), **{"rollout_dtype": "fp8", **kw})
    ServeConfig(model_path=str(path), rollout_dtype="fp8", tp_size=2, world_size=2)  # TP: test_engine_fp8_tp.py


@pytest.mark.gpu
def test_fp8_rollout_on_the_gpu_matches_the_native_reference(tmp_path, monkeypatch):
    """bf16 on a GPU: the engine's Triton FP8 GEMMs (CUDA graphs included) give the native path's log-probs. Weights
    at a real model's scale (std 0.02): the tiny checkpoints' 0.1 amplifies bf16 rounding (the engine's other
    kernels against the native ones) past the bar without any FP8 difference (0.052-0.123 on the H200)."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", seed=2, initializer_range=0.02, **WIDTHS)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    tok = load_tokenizer(path)
    fp8_rollout.quantize(model)
    prompts = [tok.encode(p) for p in PROMPTS]
    with fp8_rollout.fp8_forward(model):
        out = [g[0] for g in _engine(model, tok).generate(prompts, GREEDY)]
    monkeypatch.setenv("ARENO_KERNELS", "native")
    for p, c in zip(prompts, out):
        ref = _teacher_logprobs(model, p + c.token_ids, len(p), fp8=True).cpu()
        assert (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().mean() < 0.05
