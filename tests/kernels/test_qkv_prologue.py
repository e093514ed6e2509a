"""qkv_prologue(): Triton (interpreted on CPU) vs the native composition vs float64, and the model/engine using it."""


import pytest
import torch

from areno.kernels.attention import prologue as mod
from areno.kernels.attention.paged import store_kvcache
from areno.kernels.attention.prologue import qkv_prologue, qkv_prologue_native
from areno.kernels.dispatch import interpreting
from areno.kernels.norm import rms_norm
from areno.kernels.rope import apply_rope, rope_cos_sin

# (rtol, atol) against float64: the norm rounds twice (n, then w * n) and RoPE once, each 2^-11 relative in fp16.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
# Triton vs the native composition in the same dtype: fp32 differs by summation order only, fp16 by at most one
# rounding flip of an intermediate.
SAME = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3)}

P, BLOCK_SIZE, NUM_BLOCKS = 64, 4, 8


def _inputs(t, hq, hkv, d, rotary_dim, dtype, norm, strided, g, device="cpu", num_blocks=NUM_BLOCKS):
    width = (hq + 2 * hkv) * d
    if strided:  # rows of a wider buffer, starting mid-row: row stride != width
        qkv = torch.randn(t, width + 24, generator=g)[:, 8 : 8 + width]
    else:
        qkv = torch.randn(t, width, generator=g)
    qkv = qkv.to(device=device, dtype=dtype)
    cos, sin = rope_cos_sin(rotary_dim, P, 1e4, device=device)
    positions = torch.randint(0, P, (t,), generator=g).to(device)
    wq = wk = None
    if norm:
        wq, wk = ((1 + 0.2 * torch.randn(d, generator=g)).to(device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:t]
    if t > 1:
        slots[torch.randperm(t, generator=g)[: max(1, t // 3)]] = -1  # padding rows write nothing
    cache = torch.full((num_blocks, BLOCK_SIZE, hkv, d), float("nan"), dtype=dtype, device=device)
    return qkv, positions, cos, sin, wq, wk, cache, cache.clone(), slots.to(device)


def _close(actual, expected, tol, what):
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=tol[0], atol=tol[1], equal_nan=True, msg=lambda m: f"{what}: {m}"
    )


CASES = [  # (T, Hq, Hkv, D, rotary_dim)
    (1, 4, 2, 16, 16),
    (5, 3, 1, 64, 64),
    (17, 16, 8, 128, 128),
    (5, 4, 2, 64, 32),  # partial rotary: the last 32 dims are normed, not rotated
    (17, 3, 1, 80, 32),  # pass-through width 48: not a power of two
    (2, 40, 8, 128, 128),  # more query heads than one tile holds: the head loop runs twice
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("t,hq,hkv,d,rotary_dim", CASES)
def test_triton_matches_native_and_float64(t, hq, hkv, d, rotary_dim, norm, dtype, triton_kernels):
    g = torch.Generator().manual_seed(t * 1000 + hq * 10 + d)
    strided = t % 2 == 1
    qkv, pos, cos, sin, wq, wk, k_cache, v_cache, slots = _inputs(t, hq, hkv, d, rotary_dim, dtype, norm, strided, g)
    if t == 5:
        pos, slots = pos.int(), slots.int()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    k64, v64 = k_cache.double(), v_cache.double()
    with torch.no_grad():
        q, k, v = qkv_prologue(qkv, pos, cos, sin, hq, hkv, d, wq, wk, 1e-6, k_cache, v_cache, slots)
    nq, nk, nv = qkv_prologue_native(qkv, pos, cos, sin, hq, hkv, d, wq, wk, 1e-6, ref_k, ref_v, slots)
    w64 = [None if w is None else w.double() for w in (wq, wk)]
    q64, k64_, _ = qkv_prologue_native(
        qkv.double(), pos, cos.double(), sin.double(), hq, hkv, d, *w64, 1e-6, k64, v64, slots
    )
    assert q.shape == (t, hq, d) and k.shape == (t, hkv, d) and q.dtype == k.dtype == dtype
    for name, got, native, exact in (("q", q, nq, q64), ("k", k, nk, k64_), ("k_cache", k_cache, ref_k, k64)):
        _close(got, native, SAME[dtype], f"{name} vs native")
        _close(got, exact, TOL[dtype], f"{name} vs float64")
        if dtype == torch.float16:  # same roundings in the same order: bit-identical but for rare ties
            differ = (got != native) & ~(got.isnan() & native.isnan())
            assert differ.float().mean() <= 0.01, f"{name}: {differ.float().mean():.1%} of elements differ from native"
    r = 2 * cos.shape[1]
    if not norm:  # nothing touches the dims past rotary_dim
        assert torch.equal(q[..., r:], qkv[:, : hq * d].view(t, hq, d)[..., r:])
    # v is a view of qkv, and the value cache is a byte copy of it
    assert v.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert torch.equal(v, qkv[:, (hq + hkv) * d :].reshape(t, hkv, d)) and torch.equal(v, nv)
    assert torch.equal(v_cache, ref_v) or torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
    # padding rows (slot -1) and slots nobody owns still hold the NaN sentinel; written slots hold k exactly
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.isnan(flat_k[~written]).all() and torch.isnan(flat_v[~written]).all()
    live = slots >= 0
    assert torch.equal(flat_k[slots[live].long()], k[live]) and torch.equal(flat_v[slots[live].long()], v[live])


def test_matches_the_unfused_triton_chain(triton_kernels):
    """The fused kernel gives what the kernels it replaces give (q_norm/k_norm -> apply_rope x2 -> store_kvcache)."""
    g = torch.Generator().manual_seed(7)
    t, hq, hkv, d = 9, 4, 2, 64
    qkv, pos, cos, sin, wq, wk, k_cache, v_cache, slots = _inputs(t, hq, hkv, d, d, torch.float16, True, True, g)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    with torch.no_grad():
        q, k, v = qkv_prologue(qkv, pos, cos, sin, hq, hkv, d, wq, wk, 1e-6, k_cache, v_cache, slots)
        q0, k0, v0 = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q0 = apply_rope(rms_norm(q0.view(t, hq, d), wq, 1e-6), pos, cos, sin)
        k0 = apply_rope(rms_norm(k0.view(t, hkv, d), wk, 1e-6), pos, cos, sin)
        store_kvcache(k0, v0.view(t, hkv, d), ref_k, ref_v, slots)
    _close(q, q0, SAME[torch.float16], "q")
    _close(k, k0, SAME[torch.float16], "k")
    _close(k_cache, ref_k, SAME[torch.float16], "k_cache")
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))


def test_empty_batch(triton_kernels):
    qkv, pos, cos, sin, wq, wk, k_cache, v_cache, slots = _inputs(
        0, 2, 1, 16, 16, torch.float32, True, False, torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        q, k, v = qkv_prologue(qkv, pos, cos, sin, 2, 1, 16, wq, wk, 1e-6, k_cache, v_cache, slots)
    assert q.shape == (0, 2, 16) and k.shape == v.shape == (0, 1, 16) and torch.isnan(k_cache).all()


def test_native_dispatch_does_not_launch_triton(native_kernels, monkeypatch):
    monkeypatch.setattr(mod, "qkv_prologue_launch", lambda *a: pytest.fail("Triton path used under native"))
    args = _inputs(3, 2, 1, 16, 16, torch.float32, True, False, torch.Generator().manual_seed(1))
    qkv, pos, cos, sin, wq, wk, k_cache, v_cache, slots = args
    with torch.no_grad():
        q, _, _ = qkv_prologue(qkv, pos, cos, sin, 2, 1, 16, wq, wk, 1e-6, k_cache, v_cache, slots)
    assert torch.isfinite(q).all()


def test_rejects_bad_inputs():
    qkv, pos, cos, sin, wq, wk, k_cache, v_cache, slots = _inputs(
        3, 4, 2, 16, 16, torch.float32, True, False, torch.Generator().manual_seed(2)
    )

    def call(**kw):
        a = dict(
            qkv=qkv,
            positions=pos,
            cos=cos,
            sin=sin,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            q_norm_w=wq,
            k_norm_w=wk,
            eps=1e-6,
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=slots,
        )
        a.update(kw)
        with torch.no_grad():
            return qkv_prologue(**a)

    with pytest.raises(ValueError, match=r"qkv must be \[T, \(Hq \+ 2\*Hkv\) \* D\]"):
        call(num_heads=3)
    with pytest.raises(ValueError, match="k_cache/v_cache"):
        call(k_cache=k_cache[:, :, :1], v_cache=v_cache[:, :, :1])
    with pytest.raises(ValueError, match="must have qkv's dtype"):
        call(k_cache=k_cache.half(), v_cache=v_cache.half())
    with pytest.raises(ValueError, match="positions"):
        call(positions=pos[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=slots.float())
    with pytest.raises(ValueError, match="rotary_dim"):
        call(cos=torch.zeros(P, 9), sin=torch.zeros(P, 9))
    with pytest.raises(ValueError, match="q_norm_w"):
        call(q_norm_w=torch.ones(8))
    with pytest.raises(ValueError, match="inference only"):
        qkv_prologue(qkv.requires_grad_(), pos, cos, sin, 4, 2, 16, wq, wk, 1e-6, k_cache, v_cache, slots)


# ---- in the model and the engine -----------------------------------------------------------------------------------


@pytest.fixture
def count_launches(monkeypatch):
    """Run only the prologue on Triton (interpreted) and count its launches; other kernels keep the default path."""
    if not interpreting():
        pytest.skip("runs the CPU model with the prologue in the Triton interpreter (TRITON_INTERPRET=1)")
    calls = []
    real = mod.qkv_prologue_launch

    def launch(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(mod, "use_triton", lambda *tensors, supported=True: supported)
    monkeypatch.setattr(mod, "qkv_prologue_launch", launch)
    return calls


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from areno.models import load_model, load_tokenizer
    from areno.testing import make_tiny_checkpoint

    out = {}
    for family in ("qwen3", "llama"):
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family=family, seed=3)
        out[family] = (load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path))
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_engine_greedy_tokens_match_the_unfused_prologue(family, tiny_models, count_launches, monkeypatch):
    from areno.config import SamplingParams
    from areno.engine.engine import Engine, EngineConfig
    from areno.models.base import Attention

    model, tok = tiny_models[family]
    assert (model.layers[0].self_attn.q_norm is not None) == (family == "qwen3")
    prompts = [tok.encode(p) for p in ["hello world, 12 + 3 =", "the cat", "a b c d e f g h i j k"]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)

    def run():
        out = Engine(model, tok, EngineConfig(block_size=4, max_running=8)).generate(prompts, greedy)
        return [group[0].token_ids for group in out], [group[0].logprobs for group in out]

    fused_tokens, fused_logprobs = run()
    assert len(count_launches) >= 2 * model.num_layers  # a prefill and decodes, every layer
    monkeypatch.setattr(Attention, "fused_prologue", False)
    launches = len(count_launches)
    tokens, logprobs = run()
    assert len(count_launches) == launches  # the baseline really ran unfused
    assert fused_tokens == tokens
    torch.testing.assert_close(torch.tensor(fused_logprobs), torch.tensor(logprobs), rtol=0, atol=1e-4)


def test_training_path_does_not_use_the_fused_prologue(tiny_models, count_launches):
    """No KV cache, or grad mode on: the separate (differentiable) norm/rope kernels run."""
    model, _ = tiny_models["qwen3"]
    ids = torch.randint(0, 100, (1, 6))
    model.logits(ids).sum().backward()
    with torch.no_grad():
        model.logits(ids)
    model.zero_grad(set_to_none=True)
    assert count_launches == []


# ---- GPU: bf16 at the decode shape ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
def test_gpu_bf16_matches_the_unfused_kernels(norm):
    """At the decode shape the fused kernel agrees with the five kernels it replaces but for rare rounding flips."""
    g = torch.Generator().manual_seed(11)
    t, hq, hkv, d, dt = 256, 16, 8, 128, torch.bfloat16
    args = _inputs(t, hq, hkv, d, d, dt, norm, False, g, "cuda", num_blocks=128)
    qkv, pos, cos, sin, wq, wk, k_cache, v_cache, slots = args
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    with torch.inference_mode():
        q, k, v = qkv_prologue(*args[:4], hq, hkv, d, wq, wk, 1e-6, k_cache, v_cache, slots)
        q0, k0, v0 = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
        if norm:
            q0, k0 = rms_norm(q0, wq, 1e-6), rms_norm(k0, wk, 1e-6)
        q0, k0 = apply_rope(q0, pos, cos, sin), apply_rope(k0, pos, cos, sin)
        store_kvcache(k0, v0, ref_k, ref_v, slots)
    w64 = [None if w is None else w.double() for w in (wq, wk)]
    caches64 = (k_cache.double(), v_cache.double())
    q64, k64, _ = qkv_prologue_native(qkv.double(), pos, cos.double(), sin.double(), hq, hkv, d, *w64, 1e-6, *caches64,
                                      slots)  # fmt: skip
    for name, got, ref, want in (("q", q, q0, q64), ("k", k, k0, k64), ("k_cache", k_cache, ref_k, None)):
        if want is not None:
            _close(got, want, TOL[dt], f"{name} vs float64")
        differ = ((got != ref) & ~(got.isnan() & ref.isnan())).float().mean().item()
        gap = (got.float() - ref.float()).nan_to_num(0.0).abs().max().item()
        assert differ <= 0.01 and gap <= 2**-5, f"{name}: {differ:.2%} of elements differ, by up to {gap}"
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
