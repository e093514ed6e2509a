"""qk_norm_rope(): Triton (interpreted on CPU) vs the native composition vs float64, forward and every gradient, and
the model's training step through it."""


import pytest
import torch

from areno.kernels.attention import norm_rope as mod
from areno.kernels.attention.norm_rope import qk_norm_rope, qk_norm_rope_native
from areno.kernels.dispatch import interpreting
from areno.kernels.norm import rms_norm
from areno.kernels.rope import apply_rope, rope_cos_sin

# (rtol, atol) against float64: the norm rounds twice (n, then w * n) and RoPE once, each 2^-11 relative in fp16.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
# Gradients: fp32 sums rounded once to the dtype; dweight sums over every row, judged against its largest entry.
GRAD_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}
# Triton vs the native composition in the same dtype: fp32 differs by summation order only, fp16 by at most one
# rounding flip of an intermediate.
SAME = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3)}

P = 64


@pytest.fixture
def nan_empty(monkeypatch):
    """Every float buffer the launchers allocate starts as NaN, so an unwritten element fails the test."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def _inputs(t, hq, hkv, d, rotary_dim, dtype, norm, strided, g, device="cpu"):
    width = (hq + 2 * hkv) * d
    if strided:  # rows of a wider buffer, starting mid-row: row stride != width
        base = torch.randn(t, width + 24, generator=g).to(device=device, dtype=dtype).requires_grad_()
        qkv = base[:, 8 : 8 + width]
    else:
        base = qkv = torch.randn(t, width, generator=g).to(device=device, dtype=dtype).requires_grad_()
    cos, sin = rope_cos_sin(rotary_dim, P, 1e4, device=device)
    positions = torch.randint(0, P, (t,), generator=g).to(device)
    wq = wk = None
    if norm:
        wq, wk = ((1 + 0.2 * torch.randn(d, generator=g)).to(device=device, dtype=dtype).requires_grad_() for _ in "qk")
    return base, qkv, positions, cos, sin, wq, wk


def _close(actual, expected, tol, what, scale_by_max=False):
    rtol, atol = tol
    expected = expected.double()
    if scale_by_max:
        atol = atol * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _run(fn, base, qkv, positions, cos, sin, wq, wk, heads, upstream, eps=1e-6):
    """Outputs and the gradients of (base, wq, wk) under ``upstream`` (dq, dk, dv)."""
    q, k, v = fn(qkv, positions, cos, sin, *heads, wq, wk, eps)
    leaves = [x for x in (base, wq, wk) if x is not None and x.requires_grad]
    outs, ups = zip(*[(out, up) for out, up in zip((q, k, v), upstream) if out.requires_grad])  # v: not if frozen
    return (q, k, v), torch.autograd.grad(outs, leaves, ups)


def _as64(base, strided, wq, wk, width):
    base64 = base.detach().double().requires_grad_(base.requires_grad)
    qkv64 = base64[:, 8 : 8 + width] if strided else base64
    w64 = [None if w is None else w.detach().double().requires_grad_(w.requires_grad) for w in (wq, wk)]
    return base64, qkv64, w64


def _check_against_references(t, hq, hkv, d, rotary_dim, dtype, norm, strided, seed, int32_positions=False):
    g = torch.Generator().manual_seed(seed)
    base, qkv, pos, cos, sin, wq, wk = _inputs(t, hq, hkv, d, rotary_dim, dtype, norm, strided, g)
    if int32_positions:
        pos = pos.int()
    heads = (hq, hkv, d)
    upstream = [torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv)]
    (q, k, v), grads = _run(qk_norm_rope, base, qkv, pos, cos, sin, wq, wk, heads, upstream)
    with torch.no_grad():
        native = qk_norm_rope_native(qkv, pos, cos, sin, *heads, wq, wk, 1e-6)
    base64, qkv64, (wq64, wk64) = _as64(base, strided, wq, wk, qkv.shape[1])
    exact, exact_grads = _run(
        qk_norm_rope_native, base64, qkv64, pos, cos.double(), sin.double(), wq64, wk64, heads,
        [u.double() for u in upstream],
    )  # fmt: skip
    assert q.shape == (t, hq, d) and k.shape == v.shape == (t, hkv, d)
    assert q.dtype == k.dtype == v.dtype == dtype
    for name, got, same, want in zip("qkv", (q, k, v), native, exact):
        _close(got, same, SAME[dtype], f"{name} vs native")
        _close(got, want, TOL[dtype], f"{name} vs float64")
        if dtype == torch.float16:  # same roundings in the same order: bit-identical but for rare ties
            differ = (got != same).float().mean().item()
            assert differ <= 0.01, f"{name}: {differ:.1%} of elements differ from native"
    # v is a view of qkv (no copy), the forward never writes it
    assert v.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert torch.equal(v, qkv[:, (hq + hkv) * d :].reshape(t, hkv, d))
    r = 2 * cos.shape[1]
    if not norm:  # nothing touches the dims past rotary_dim
        assert torch.equal(q[..., r:], qkv[:, : hq * d].reshape(t, hq, d)[..., r:])
    names = ["dqkv", "dq_norm_weight", "dk_norm_weight"]
    assert len(grads) == len(exact_grads) == (3 if norm else 1)
    for name, got, want in zip(names, grads, exact_grads):
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        _close(got, want, GRAD_TOL[dtype], name, scale_by_max=name != "dqkv")
    dbase = grads[0]
    if strided:  # the columns outside the view get nothing
        assert (dbase[:, :8] == 0).all() and (dbase[:, 8 + qkv.shape[1] :] == 0).all()
    # the v columns of dqkv are dv exactly
    dv_cols = dbase[:, (8 if strided else 0) + (hq + hkv) * d :][:, : hkv * d]
    assert torch.equal(dv_cols, upstream[2].reshape(t, hkv * d))


CASES = [  # (T, Hq, Hkv, D, rotary_dim)
    (1, 2, 1, 16, 16),
    (5, 4, 4, 32, 32),  # MHA
    (7, 3, 1, 80, 32),  # partial rotary, pass-through width 48: not a power of two
    (9, 2, 1, 48, 48),  # D/2 = 24: masked half columns
    (13, 4, 2, 64, 32),  # partial rotary, GQA, many tiles and several per backward program
    (11, 2, 1, 24, 8),  # padded rows 24 wide: the interpreter's 128-element tile holds 5 rows, rounded down to 4
]


@pytest.mark.parametrize("width", [320, 96, 24, 40, 128, 4096, 8192])
def test_row_tiles_are_powers_of_two(width):
    """Qwen3.5's partial RoPE (D=256, rotary 64) pads a head row to 32 + 32 + 256 = 320 elements: every tiling of the
    forward, the backward and its autotuned candidates is still a power of 2 (tl.arange's rule; it failed to compile
    on the GPU before)."""
    for rows in (1, 3, 100, 10**6):
        for elements in (mod._FWD_TILE, mod._BWD_TILE, mod._INTERPRETER_TILE, *(t for t, _ in mod._BWD_TILES)):
            r = mod._tiles(rows, width, elements)
            assert r >= 1 and r & (r - 1) == 0, (rows, width, elements, r)
    for cfg in mod._tuned_bwd(width, 256).configs:
        for key in ("BLOCK_R", "BLOCK_RV"):
            assert cfg.kwargs[key] & (cfg.kwargs[key] - 1) == 0, (width, cfg.kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("t,hq,hkv,d,rotary_dim", CASES)
def test_triton_matches_native_and_float64(t, hq, hkv, d, rotary_dim, norm, dtype, triton_kernels, nan_empty):
    _check_against_references(
        t, hq, hkv, d, rotary_dim, dtype, norm, strided=t % 2 == 1, seed=t * 1000 + hq * 10 + d,
        int32_positions=t == 5,
    )  # fmt: skip


def test_matches_the_unfused_triton_chain(triton_kernels):
    """Forward and gradients equal what the kernels it replaces give (split -> rms_norm x2 -> apply_rope x2)."""
    g = torch.Generator().manual_seed(7)
    t, hq, hkv, d, dt = 9, 4, 2, 64, torch.float16
    base, qkv, pos, cos, sin, wq, wk = _inputs(t, hq, hkv, d, d, dt, True, False, g)
    upstream = [torch.randn(t, h, d, generator=g).to(dt) for h in (hq, hkv, hkv)]

    def unfused(qkv, pos, cos, sin, hq, hkv, d, wq, wk, eps):
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
        q, k = rms_norm(q, wq, eps), rms_norm(k, wk, eps)
        return apply_rope(q, pos, cos, sin), apply_rope(k, pos, cos, sin), v

    outs, grads = _run(qk_norm_rope, base, qkv, pos, cos, sin, wq, wk, (hq, hkv, d), upstream)
    ref_outs, ref_grads = _run(unfused, base, qkv, pos, cos, sin, wq, wk, (hq, hkv, d), upstream)
    for name, got, ref in zip("qkv", outs, ref_outs):
        _close(got, ref, SAME[dt], name)
        assert (got != ref).float().mean() <= 0.01, name
    # the unfused chain rounds the RoPE backward to fp16 before the norm backward; the fused one does not
    for name, got, ref in zip(["dqkv", "dwq", "dwk"], grads, ref_grads):
        _close(got, ref, GRAD_TOL[dt], name, scale_by_max=name != "dqkv")


def test_weight_grads_only_and_frozen_weights(triton_kernels, nan_empty):
    """Gradients asked for a subset of the inputs: only the weights (qkv frozen), or only qkv (frozen norms)."""
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 6, 2, 1, 32
    base, qkv, pos, cos, sin, wq, wk = _inputs(t, hq, hkv, d, d, torch.float32, True, False, g)
    upstream = [torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv)]
    frozen = base.detach()
    (_, grads) = _run(qk_norm_rope, frozen, frozen, pos, cos, sin, wq, wk, (hq, hkv, d), upstream)
    b64, _, (wq64, wk64) = _as64(frozen, False, wq, wk, 0)
    (_, want) = _run(qk_norm_rope_native, b64, b64, pos, cos.double(), sin.double(), wq64, wk64, (hq, hkv, d),
                     [u.double() for u in upstream])  # fmt: skip
    assert len(grads) == 2
    for got, ref in zip(grads, want):
        _close(got, ref, GRAD_TOL[torch.float32], "dweight", scale_by_max=True)
    wq0, wk0 = wq.detach(), wk.detach()
    (_, (dqkv,)) = _run(qk_norm_rope, base, qkv, pos, cos, sin, wq0, wk0, (hq, hkv, d), upstream)
    (_, (dqkv64,)) = _run(qk_norm_rope_native, b64.requires_grad_(), b64, pos, cos.double(), sin.double(),
                          wq0.double(), wk0.double(), (hq, hkv, d), [u.double() for u in upstream])  # fmt: skip
    _close(dqkv, dqkv64, GRAD_TOL[torch.float32], "dqkv")


def test_unused_outputs_and_empty_batch(triton_kernels):
    """An output without a gradient counts as zeros (its dqkv columns are 0); T=0 gives empty outputs and grads."""
    g = torch.Generator().manual_seed(4)
    base, qkv, pos, cos, sin, wq, wk = _inputs(3, 2, 1, 16, 16, torch.float32, True, False, g)
    q, k, v = qk_norm_rope(qkv, pos, cos, sin, 2, 1, 16, wq, wk, 1e-6)
    (dqkv,) = torch.autograd.grad(q.sum(), [qkv])
    assert (dqkv[:, 32:] == 0).all() and (dqkv[:, :32] != 0).any()
    base, qkv, pos, cos, sin, wq, wk = _inputs(0, 2, 1, 16, 16, torch.float32, True, False, g)
    q, k, v = qk_norm_rope(qkv, pos, cos, sin, 2, 1, 16, wq, wk, 1e-6)
    assert q.shape == (0, 2, 16) and k.shape == v.shape == (0, 1, 16)
    dqkv, dwq, dwk = torch.autograd.grad((q.sum() + k.sum() + v.sum()), [qkv, wq, wk], allow_unused=True)
    assert dqkv.shape == (0, 64) and all(w is None or (w == 0).all() for w in (dwq, dwk))


def test_unsupported_inputs_run_native(native_kernels, monkeypatch):
    """ARENO_KERNELS=native never launches; one weight alone or a weight in another dtype is native even on auto."""
    fail = lambda *a, **k: pytest.fail("Triton path used")  # noqa: E731
    monkeypatch.setattr(mod, "qk_norm_rope_fwd", fail)
    g = torch.Generator().manual_seed(5)
    base, qkv, pos, cos, sin, wq, wk = _inputs(3, 2, 1, 16, 16, torch.float16, True, False, g)
    q, k, _ = qk_norm_rope(qkv, pos, cos, sin, 2, 1, 16, wq, wk, 1e-6)
    assert torch.isfinite(q).all()
    monkeypatch.setattr(mod, "use_triton", lambda *tensors, supported=True: supported)
    q, k, _ = qk_norm_rope(qkv, pos, cos, sin, 2, 1, 16, wq, None, 1e-6)
    assert q.dtype == k.dtype == torch.float16
    q, k, _ = qk_norm_rope(qkv, pos, cos, sin, 2, 1, 16, wq.float(), wk.float(), 1e-6)
    assert q.dtype == k.dtype == torch.float32  # rms_norm promotes to the weight's dtype, as unfused


def test_rejects_bad_inputs():
    g = torch.Generator().manual_seed(6)
    base, qkv, pos, cos, sin, wq, wk = _inputs(3, 4, 2, 16, 16, torch.float32, True, False, g)
    with pytest.raises(ValueError, match=r"qkv must be \[T, \(Hq \+ 2\*Hkv\) \* D\]"):
        qk_norm_rope(qkv, pos, cos, sin, 3, 2, 16, wq, wk, 1e-6)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope(qkv, pos[:2], cos, sin, 4, 2, 16, wq, wk, 1e-6)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope(qkv, pos, torch.zeros(P, 9), torch.zeros(P, 9), 4, 2, 16, wq, wk, 1e-6)
    with pytest.raises(ValueError, match="k_norm_weight"):
        qk_norm_rope(qkv, pos, cos, sin, 4, 2, 16, wq, torch.ones(8), 1e-6)


# ---- in the model ---------------------------------------------------------------------------------------------------


@pytest.fixture
def count_launches(monkeypatch):
    """Run only qk_norm_rope on Triton (interpreted) and count its launches; other kernels keep the default path."""
    if not interpreting():
        pytest.skip("runs the CPU model with qk_norm_rope in the Triton interpreter (TRITON_INTERPRET=1)")
    calls = {"fwd": 0, "bwd": 0}

    def counted(name, real):
        def launch(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return launch

    monkeypatch.setattr(mod, "use_triton", lambda *tensors, supported=True: supported)
    monkeypatch.setattr(mod, "qk_norm_rope_fwd", counted("fwd", mod.qk_norm_rope_fwd))
    monkeypatch.setattr(mod, "qk_norm_rope_bwd", counted("bwd", mod.qk_norm_rope_bwd))
    return calls


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_model_training_step_matches_the_unfused_path(family, tmp_path, count_launches, monkeypatch):
    """The training loss and every parameter's gradient equal those of the split -> norm -> rope chain, with and
    without activation checkpointing (the fused forward runs again in the recompute)."""
    from areno.models import load_model
    from areno.models.base import Attention
    from areno.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, family=family, seed=3)
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(8))
    positions, cu = torch.arange(7).repeat(2), torch.tensor([0, 7, 14], dtype=torch.int32)
    targets = torch.roll(ids, -1, 1).reshape(-1)

    def step(checkpointing=False):
        model = load_model(path, device="cpu").train()
        model.set_activation_checkpointing(checkpointing)
        loss = -model.token_logprobs(model(ids.reshape(-1), positions, cu, 7), targets).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = step()
    layers = 2
    assert count_launches == {"fwd": layers, "bwd": layers}
    loss_ckpt, grads_ckpt = step(checkpointing=True)
    assert count_launches == {"fwd": 3 * layers, "bwd": 2 * layers}
    monkeypatch.setattr(Attention, "fused_prologue", False)
    ref_loss, ref_grads = step()
    assert count_launches == {"fwd": 3 * layers, "bwd": 2 * layers}  # the baseline really ran unfused
    if family == "qwen3":
        assert ref_grads["layers.0.self_attn.q_norm.weight"].abs().max() > 0
    for got_loss, got_grads in ((loss, grads), (loss_ckpt, grads_ckpt)):
        torch.testing.assert_close(got_loss, ref_loss, rtol=1e-6, atol=1e-6)
        assert got_grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            scale = ref.abs().max().clamp_min(1e-8).item()
            assert (got_grads[name] - ref).abs().max() <= 1e-5 * scale, name


# ---- GPU: bf16 at a training shape ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
def test_gpu_bf16_training_shape(norm):
    """T=4096, Hq=16, Hkv=8, D=128 in bf16: outputs and gradients against float64, outputs against the unfused
    kernels (rare one-ulp flips)."""
    g = torch.Generator().manual_seed(12)
    t, hq, hkv, d, dt = 4096, 16, 8, 128, torch.bfloat16
    base, qkv, pos, cos, sin, wq, wk = _inputs(t, hq, hkv, d, d, dt, norm, True, g, device="cuda")
    heads = (hq, hkv, d)
    upstream = [torch.randn(t, h, d, generator=g).to("cuda", dt) for h in (hq, hkv, hkv)]
    outs, grads = _run(qk_norm_rope, base, qkv, pos, cos, sin, wq, wk, heads, upstream)
    base64, qkv64, (wq64, wk64) = _as64(base, True, wq, wk, qkv.shape[1])
    exact, exact_grads = _run(qk_norm_rope_native, base64, qkv64, pos, cos.double(), sin.double(), wq64, wk64, heads,
                              [u.double() for u in upstream])  # fmt: skip
    with torch.no_grad():
        q0, k0, _ = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
        if norm:
            q0, k0 = rms_norm(q0, wq, 1e-6), rms_norm(k0, wk, 1e-6)
        unfused = (apply_rope(q0, pos, cos, sin), apply_rope(k0, pos, cos, sin))
    for name, got, want in zip("qkv", outs, exact):
        _close(got, want, TOL[dt], f"{name} vs float64")
    for name, got, ref in zip("qk", outs, unfused):
        differ = (got != ref).float().mean().item()
        # a one-ulp flip of the normed value moves an output by at most ~2^-8 of its head row's largest value (RoPE
        # may cancel the element itself: on the H200 one element in 5e5 differed by 1.3% of its own size)
        row = ref.float().abs().amax(-1, keepdim=True).clamp_min(1e-3)
        gap = ((got.float() - ref.float()).abs() / row).max().item()
        assert differ <= 0.01 and gap <= 2**-7, f"{name}: {differ:.2%} of elements differ, gap {gap} of the row max"
    for name, got, want in zip(["dqkv", "dwq", "dwk"], grads, exact_grads):
        _close(got, want, GRAD_TOL[dt], name, scale_by_max=name != "dqkv")
