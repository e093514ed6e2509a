"""RoPE: tables and config parsing vs Hugging Face; apply_rope Triton (interpreted) vs native vs float64, fwd+bwd."""

import pytest
import torch

from areno.kernels import rope as mod
from areno.kernels.rope import apply_rope, apply_rope_native, rope_cos_sin, rope_params_from_config

# (rtol, atol) against the float64 reference: fp32 differs by fma/rounding order only; fp16/bf16 round the output
# once (2^-11 / 2^-8 relative).
TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-4), torch.bfloat16: (8e-3, 1e-3)}

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}


@pytest.fixture
def nan_empty(monkeypatch):
    """Every float buffer the launchers allocate starts as NaN, so an unwritten element fails the test."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(real_empty_like(*a, **k)))


def _close(actual, expected, tol):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol[0], atol=tol[1])


def _hf_tables(head_dim, rope_parameters, positions, max_position=4096):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rope_parameters=dict(rope_parameters),
    )
    x = torch.zeros(1, len(positions), head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions[None].long())
    return config, cos[0], sin[0]


# ---- tables and config -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "head_dim,params,max_position",
    [
        (128, {"rope_type": "default", "rope_theta": 1e6}, 40960),
        (64, {"rope_type": "default", "rope_theta": 10000.0}, 4096),
        (80, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 4096),
        (128, LLAMA3, 131072),
        (64, {**LLAMA3, "original_max_position_embeddings": 2048, "factor": 4.0}, 16384),
        (64, YARN, 8192),  # GPT-OSS: no truncation of the correction range
        (64, {**YARN, "truncate": True, "beta_fast": None}, 8192),
        (128, {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707}, 8192),  # DeepSeek-style attention factor
        (64, {**YARN, "attention_factor": 1.25}, 4096),
    ],
)
def test_tables_match_hugging_face(head_dim, params, max_position):
    positions = torch.cat([torch.tensor([0, 1, max_position - 1]), torch.randint(0, max_position, (61,))])
    config, hf_cos, hf_sin = _hf_tables(head_dim, params, positions, max_position)
    base, scaling, rotary_dim = rope_params_from_config(config)
    assert rotary_dim == head_dim and base == params["rope_theta"]
    cos, sin = rope_cos_sin(rotary_dim, max_position, base, rope_scaling=scaling)
    assert cos.shape == sin.shape == (max_position, head_dim // 2) and cos.dtype == torch.float32
    torch.testing.assert_close(torch.cat([cos, cos], -1)[positions], hf_cos, rtol=0, atol=2e-7)
    torch.testing.assert_close(torch.cat([sin, sin], -1)[positions], hf_sin, rtol=0, atol=2e-7)


def test_llama3_scaling_touches_all_three_bands():
    plain = mod.rope_inv_freq(128, 500000.0)
    scaled = mod.rope_inv_freq(128, 500000.0, LLAMA3)
    ratio = plain / scaled
    assert ratio[0] == 1.0 and ratio[-1] == 8.0  # high frequencies kept, low ones slowed by `factor`
    assert ((ratio > 1.0) & (ratio < 8.0)).any()  # the smoothed band in between
    same = mod.rope_inv_freq(128, 500000.0, {**{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"})
    assert torch.equal(same, scaled)
    assert torch.equal(mod.rope_inv_freq(64, 1e4, None), mod.rope_inv_freq(64, 1e4, {"rope_type": "default"}))
    with pytest.raises(NotImplementedError, match="dynamic"):
        mod.rope_inv_freq(64, 1e4, {"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        mod.rope_inv_freq(64, 1e4, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="missing"):
        mod.rope_inv_freq(64, 1e4, {"rope_type": "llama3", "factor": 8.0})


def test_rope_params_from_config_old_and_new_fields():
    from transformers import LlamaConfig, Qwen3Config

    qwen = Qwen3Config(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert rope_params_from_config(qwen) == (1e6, None, 128)
    assert rope_params_from_config(qwen.to_dict()) == (1e6, None, 128)
    llama = LlamaConfig(hidden_size=512, num_attention_heads=8, max_position_embeddings=131072, rope_parameters=LLAMA3)
    base, scaling, rotary_dim = rope_params_from_config(llama)
    assert (base, rotary_dim) == (500000.0, 64)
    assert scaling == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    assert rope_params_from_config(llama.to_dict()) == (base, scaling, rotary_dim)
    # transformers 4 style config.json: top-level rope_theta / rope_scaling ("type") / partial_rotary_factor
    old = {
        "hidden_size": 512,
        "num_attention_heads": 8,
        "rope_theta": 10000,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "partial_rotary_factor": 0.5,
    }
    assert rope_params_from_config(old) == (10000.0, {"rope_type": "linear", "factor": 2.0}, 32)
    old_llama3 = {"head_dim": 128, "rope_theta": 5e5, "max_position_embeddings": 8192, "rope_scaling": None}
    old_llama3["rope_scaling"] = {
        k: v for k, v in LLAMA3.items() if k not in ("rope_theta", "original_max_position_embeddings")
    }
    assert rope_params_from_config(old_llama3)[1]["original_max_position_embeddings"] == 8192
    new = {
        "head_dim": 96,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    }
    assert rope_params_from_config(new) == (1e6, None, 24)
    assert rope_params_from_config({"head_dim": 64}) == (10000.0, None, 64)


# ---- apply_rope --------------------------------------------------------------------------------------------------


def _apply_hf(x, positions, cos, sin):
    """Hugging Face's apply_rotary_pos_emb on the rotary part, the rest passed through (as partial-rotary models do)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    r = 2 * cos.shape[-1]
    c = torch.cat([cos, cos], -1)[positions.long()]
    s = torch.cat([sin, sin], -1)[positions.long()]
    rot, _ = apply_rotary_pos_emb(x[..., :r], x[..., :r], c, s, unsqueeze_dim=1)
    return torch.cat([rot, x[..., r:]], -1)


@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (96, 32)])
def test_apply_rope_matches_hugging_face_fp32(triton_kernels, head_dim, rotary_dim):
    cos, sin = rope_cos_sin(rotary_dim, 8192, 500000.0, rope_scaling=LLAMA3)
    x = torch.randn(37, 5, head_dim)
    positions = torch.randint(0, 8192, (37,))
    _close(apply_rope(x, positions, cos, sin), _apply_hf(x, positions, cos, sin), TOL[torch.float32])


def _check(x, positions, cos, sin, dtype):
    y = apply_rope(x, positions, cos, sin)
    assert y.dtype == x.dtype and y.shape == x.shape
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, [x], dy)
    x64 = x.detach().double().requires_grad_()
    y64 = apply_rope_native(x64, positions, cos.double(), sin.double())
    (dx64,) = torch.autograd.grad(y64, [x64], dy.double())
    _close(y, y64, TOL[dtype])
    _close(y, apply_rope_native(x.detach(), positions, cos, sin), TOL[dtype])
    _close(dx, dx64, TOL[dtype])
    r = 2 * cos.shape[-1]
    assert torch.equal(y[..., r:], x.detach()[..., r:]) and torch.equal(dx[..., r:], dy[..., r:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,heads,head_dim,rotary_dim",
    [(1, 1, 64, 64), (7, 3, 96, 32), (127, 1, 64, 64), (129, 3, 96, 32), (7, 8, 80, 80), (129, 5, 128, 64)],
)
def test_apply_rope_triton_matches_references(triton_kernels, nan_empty, tokens, heads, head_dim, rotary_dim, dtype):
    cos, sin = rope_cos_sin(rotary_dim, 1000, 10000.0)
    x = torch.randn(tokens, heads, head_dim, dtype=dtype, requires_grad=True)
    pos_dtype = torch.int32 if tokens % 2 else torch.int64
    positions = torch.randint(0, 1000, (tokens,), dtype=pos_dtype)
    _check(x, positions, cos, sin, dtype)


def test_apply_rope_on_strided_slice_of_fused_qkv(triton_kernels, nan_empty):
    t, hq, hkv, d = 11, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, requires_grad=True)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    cos, sin = rope_cos_sin(d, 64, 1e6)
    positions = torch.arange(t) + 3
    y = apply_rope(k, positions, cos, sin)
    dy = torch.randn_like(y)
    (dqkv,) = torch.autograd.grad(y, [qkv], dy)
    qkv64 = qkv.detach().double().requires_grad_()
    y64 = apply_rope_native(qkv64[:, hq * d : (hq + hkv) * d].view(t, hkv, d), positions, cos.double(), sin.double())
    (dqkv64,) = torch.autograd.grad(y64, [qkv64], dy.double())
    _close(y, y64, TOL[torch.float32])
    _close(dqkv, dqkv64, TOL[torch.float32])


def test_native_dispatch_does_not_launch_triton(native_kernels, monkeypatch):
    monkeypatch.setattr(mod.RopeFunction, "apply", lambda *a: pytest.fail("Triton path used under native"))
    cos, sin = rope_cos_sin(32, 16, 1e4)
    x, positions = torch.randn(4, 2, 32), torch.tensor([0, 5, 9, 15])
    _close(apply_rope(x, positions, cos, sin), _apply_hf(x, positions, cos, sin), TOL[torch.float32])


def test_launcher_rejects_bad_shapes():
    cos, sin = rope_cos_sin(64, 16, 1e4)
    with pytest.raises(AssertionError, match="rotary_dim"):
        mod.rope_launch(torch.randn(3, 2, 32), torch.zeros(3, dtype=torch.long), cos, sin)
    with pytest.raises(AssertionError, match="positions"):
        mod.rope_launch(torch.randn(3, 2, 64), torch.zeros(4, dtype=torch.long), cos, sin)
    with pytest.raises(AssertionError, match="tokens, heads, head_dim"):
        mod.rope_launch(torch.randn(3, 64), torch.zeros(3, dtype=torch.long), cos, sin)


# ---- GPU: bf16 at real sizes -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim,rotary_dim", [(16, 128, 128), (8, 128, 64), (32, 80, 80)])
def test_apply_rope_gpu_bf16(heads, head_dim, rotary_dim):
    cos, sin = rope_cos_sin(rotary_dim, 40960, 1e6, device="cuda")
    x = torch.randn(16384, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.randint(0, 40960, (16384,), device="cuda", dtype=torch.int32)
    _check(x, positions, cos, sin, torch.bfloat16)


@pytest.mark.gpu
def test_tables_on_gpu_match_hugging_face_on_gpu():
    positions = torch.randint(0, 131072, (4096,))
    config, _, _ = _hf_tables(128, LLAMA3, positions[:1], 131072)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cos, hf_sin = LlamaRotaryEmbedding(config).cuda()(torch.zeros(1, device="cuda"), positions[None].cuda())
    base, scaling, rotary_dim = rope_params_from_config(config)
    cos, sin = rope_cos_sin(rotary_dim, 131072, base, rope_scaling=scaling, device="cuda")
    torch.testing.assert_close(torch.cat([cos, cos], -1)[positions.cuda()], hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([sin, sin], -1)[positions.cuda()], hf_sin[0], rtol=0, atol=1e-6)


@pytest.mark.gpu
def test_apply_rope_cuda_graph_replay():
    cos, sin = rope_cos_sin(128, 4096, 1e6, device="cuda")
    x = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        apply_rope(x, positions, cos, sin)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = apply_rope(x, positions, cos, sin)
    x.copy_(torch.randn_like(x))
    positions.copy_(torch.randint(0, 4096, (64,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    _close(y, apply_rope_native(x, positions, cos, sin), TOL[torch.bfloat16])
