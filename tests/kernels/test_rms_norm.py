"""rms_norm: Triton (interpreted on CPU) vs native vs a float64 reference, forward and every gradient."""


import pytest
import torch

from areno.kernels import norm as mod
from areno.kernels.norm import rms_norm, rms_norm_native

# (rtol, atol) against the float64 reference. fp16: the output is rounded twice (n, then weight * n), each
# 2^-11 relative; gradients are fp32 sums rounded once to fp16.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
GRAD_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}


@pytest.fixture
def nan_empty(monkeypatch):
    """Every float buffer the launchers allocate starts as NaN, so an unwritten element fails the test."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(real_empty_like(*a, **k)))


def _close(actual, expected, tol, scale_by_max=False):
    rtol, atol = tol
    expected = expected.double()
    if scale_by_max:  # sums over many rows: judge the error against the size of the result
        atol = atol * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


def _grads(fn, inputs, upstream):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return outs, torch.autograd.grad(outs, [t for t in inputs if t is not None], upstream)


def _inputs(rows, hidden, dtype, residual, device="cpu"):
    x = torch.randn(rows, hidden, dtype=dtype, device=device) * 2
    w = 1 + 0.5 * torch.randn(hidden, dtype=dtype, device=device)
    r = torch.randn(rows, hidden, dtype=dtype, device=device) if residual else None
    return [t.requires_grad_() if t is not None else None for t in (x, w, r)]


def _check_against_references(x, w, r, eps, dtype, zero_centered=False):
    upstream = [torch.randn_like(x)] + ([torch.randn_like(x)] if r is not None else [])
    fn = lambda x, w, r: rms_norm(x, w, eps, residual=r, zero_centered=zero_centered)
    outs, grads = _grads(fn, (x, w, r), upstream)
    ref = lambda x, w, r: rms_norm_native(x, w, eps, residual=r, zero_centered=zero_centered)
    as64 = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, r)]
    ref_outs, ref_grads = _grads(ref, as64, [u.double() for u in upstream])
    with torch.no_grad():
        native_outs = ref(x, w, r)
        native_outs = native_outs if isinstance(native_outs, tuple) else (native_outs,)
    for out, ref_out, native_out in zip(outs, ref_outs, native_outs):
        assert out.dtype == x.dtype and out.shape == x.shape
        _close(out, ref_out, TOL[dtype])
        _close(out, native_out, TOL[dtype])
    names = ["dx", "dweight", "dresidual"]
    for name, g, ref_g in zip(names, grads, ref_grads):
        assert torch.isfinite(g).all(), name
        _close(g, ref_g, GRAD_TOL[dtype], scale_by_max=name == "dweight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 80), (7, 96), (127, 1000), (129, 80), (129, 96)])
def test_rms_norm_triton_matches_references(triton_kernels, nan_empty, rows, hidden, dtype, residual):
    x, w, r = _inputs(rows, hidden, dtype, residual)
    _check_against_references(x, w, r, 1e-6, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 80), (7, 96), (129, 96)])
def test_zero_centered_matches_references(triton_kernels, nan_empty, rows, hidden, dtype, residual):
    """Qwen3.5's norm (``1 + weight``, the product in fp32 rounded once): forward and every gradient."""
    x, w, r = _inputs(rows, hidden, dtype, residual)
    with torch.no_grad():
        w.sub_(1.0)  # zero-centred weights sit around 0
    _check_against_references(x, w, r, 1e-6, dtype, zero_centered=True)


def test_zero_centered_equals_the_layer_s_former_composition(triton_kernels, nan_empty):
    """Bit for bit the forward Qwen3.5's layers computed before the fused kernel: the residual sum in the input
    dtype, then rms_norm of its fp32 copy with the fp32 scale 1 + w, rounded to the input dtype."""
    x, w, r = (t.detach() for t in _inputs(33, 96, torch.float16, True))
    y, h = rms_norm(x, w, 1e-6, residual=r, zero_centered=True)
    h_ref = x + r
    y_ref = rms_norm(h_ref.float(), 1.0 + w.float(), 1e-6).to(x.dtype)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)


def test_rms_norm_eps_and_leading_shape(triton_kernels, nan_empty):
    x = torch.randn(3, 5, 7, 48).requires_grad_()
    w = torch.randn(48).requires_grad_()
    _check_against_references(x, w, None, 1e-2, torch.float32)


def test_residual_with_differently_strided_operands(triton_kernels, nan_empty):
    x = torch.randn(5, 3, 40, requires_grad=True)
    r_base = torch.randn(3, 5, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    r = r_base.transpose(0, 1)  # rows not evenly spaced: the launcher falls back to contiguous copies
    upstream = [torch.randn_like(x), torch.randn_like(x)]
    outs, grads = _grads(lambda x, w, r: rms_norm(x, w, 1e-6, residual=r), (x, w, r), upstream)
    as64 = [t.detach().double().requires_grad_() for t in (x, w, r)]
    ref = lambda x, w, r: rms_norm_native(x, w, 1e-6, residual=r)
    ref_outs, ref_grads = _grads(ref, as64, [u.double() for u in upstream])
    for out, ref_out in zip(outs, ref_outs):
        _close(out, ref_out, TOL[torch.float32])
    for g, ref_g in zip(grads, ref_grads):
        _close(g, ref_g, GRAD_TOL[torch.float32], scale_by_max=True)


def test_qk_norm_on_strided_view_reads_in_place(triton_kernels, nan_empty):
    """Qwen3's per-head q norm on a [T, H, D] slice of a fused qkv projection: no copy, grads into the slice."""
    t, hq, hkv, d = 13, 4, 2, 80
    qkv = torch.randn(t, (hq + 2 * hkv) * d, requires_grad=True)
    w = torch.randn(d, requires_grad=True)
    q = qkv[:, : hq * d].view(t, hq, d)
    assert not q.is_contiguous()
    view, heads, _, _ = mod.row_view(q)
    assert view.data_ptr() == q.data_ptr() and heads == hq, "the strided q view would be copied"
    y = rms_norm(q, w, 1e-6)
    dy = torch.randn_like(y)
    dqkv, dw = torch.autograd.grad(y, [qkv, w], dy)
    qkv64, w64 = qkv.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = rms_norm_native(qkv64[:, : hq * d].view(t, hq, d), w64, 1e-6)
    dqkv64, dw64 = torch.autograd.grad(y64, [qkv64, w64], dy.double())
    _close(y, y64, TOL[torch.float32])
    _close(dqkv, dqkv64, GRAD_TOL[torch.float32])
    assert (dqkv[:, hq * d :] == 0).all()
    _close(dw, dw64, GRAD_TOL[torch.float32], scale_by_max=True)


def test_weight_only_grad_and_promoted_output(triton_kernels, nan_empty):
    x = torch.randn(9, 96, dtype=torch.float16)
    w = torch.randn(96, dtype=torch.float32, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32  # weight * n.to(fp16) promotes to fp32, as in Hugging Face
    _close(y, rms_norm_native(x, w.detach(), 1e-6), TOL[torch.float32])
    dy = torch.randn_like(y)
    (dw,) = torch.autograd.grad(y, [w], dy)
    (dw_ref,) = torch.autograd.grad(rms_norm_native(x.double(), w.double(), 1e-6), [w], dy.double())
    _close(dw, dw_ref, GRAD_TOL[torch.float16], scale_by_max=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_hugging_face_rmsnorm(triton_kernels, dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    hf = Qwen3RMSNorm(200, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(200))
    x = torch.randn(31, 200, dtype=dtype)
    with torch.no_grad():
        expected = hf(x)
        actual = rms_norm(x, hf.weight, 1e-6)
    # Same rounding order: at most one ulp apart (rstd's reduction order may differ in the last bit).
    ulp = {torch.float32: 2**-23, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(actual, expected, rtol=2 * ulp, atol=1e-6)


def test_native_dispatch_does_not_launch_triton(native_kernels, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("Triton path used under ARENO_KERNELS=native")

    monkeypatch.setattr(mod.RMSNormFunction, "apply", boom)
    x, w, r = torch.randn(5, 40), torch.randn(40), torch.randn(5, 40)
    y, h = rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, rms_norm_native(x + r, w, 1e-6))


def test_launcher_rejects_bad_shapes():
    with pytest.raises(AssertionError, match="weight must be"):
        mod.rms_norm_fwd(torch.randn(4, 8), torch.randn(9))
    with pytest.raises(AssertionError, match="residual"):
        mod.rms_norm_fwd(torch.randn(4, 8), torch.randn(8), residual=torch.randn(4, 9))


# ---- GPU: bf16 at real sizes -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows,hidden", [(16384, 1024), (4099, 4096), (333, 5120)])
def test_rms_norm_gpu_bf16(rows, hidden, residual):
    x, w, r = _inputs(rows, hidden, torch.bfloat16, residual, device="cuda")
    _check_against_references(x, w, r, 1e-6, torch.bfloat16)


@pytest.mark.gpu
def test_qk_norm_gpu_bf16_matches_hugging_face():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    t, hq, hkv, d = 8192, 16, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    hf = Qwen3RMSNorm(d, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(d))
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        # Hugging Face rounds twice (the normalised value to bf16, then the product with the weight), areno once:
        # over 8M elements a few land 2 bf16 ulps apart, so the tolerance is 2 ulps (2^-6 relative)
        torch.testing.assert_close(rms_norm(k, hf.weight, 1e-6), hf(k), rtol=2**-6, atol=1e-3)


@pytest.mark.gpu
def test_rms_norm_cuda_graph_replay():
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rms_norm(x, w, 1e-6, residual=r)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = rms_norm(x, w, 1e-6, residual=r)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    y_ref, h_ref = rms_norm_native(x, w, 1e-6, residual=r)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(mod.BWD_TILES)))
def test_every_backward_tiling_gpu_bf16(index, monkeypatch):
    """Whichever tiling the backward's autotuner picks is exact: each one alone, on rows that leave a partial tile
    and a partial last wave, with the residual's gradient, and on a strided per-head (QK-norm) view."""
    monkeypatch.setattr(mod, "BWD_TILES", [mod.BWD_TILES[index]])
    mod.tuned_bwd.cache_clear()
    try:
        x, w, r = _inputs(4099, 1024, torch.bfloat16, True, device="cuda")
        _check_against_references(x, w, r, 1e-6, torch.bfloat16)
        qkv = torch.randn(3001, 32 * 128, device="cuda", dtype=torch.bfloat16)
        k = qkv[:, 16 * 128 : 24 * 128].view(3001, 8, 128).detach().requires_grad_()
        wk = (1 + 0.5 * torch.randn(128, device="cuda", dtype=torch.bfloat16)).requires_grad_()
        _check_against_references(k, wk, None, 1e-6, torch.bfloat16)
    finally:
        mod.tuned_bwd.cache_clear()


@pytest.mark.parametrize("shape,dtype", [((1, 1), torch.float32), ((37, 50), torch.float16),
                                         ((2, 19, 33), torch.float32),
                                         pytest.param((528, 1024), torch.bfloat16, marks=pytest.mark.gpu),
                                         pytest.param((2, 528, 128), torch.bfloat16, marks=pytest.mark.gpu)])
def test_sum_rows_matches_float64(shape, dtype, triton_kernels, monkeypatch):
    """The weight-gradient partials' reduction: one launch, fp32 sums rounded once to the weight's dtype."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    part = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dev)
    launched = []
    real = mod.sum_rows_kernel
    monkeypatch.setattr(mod, "sum_rows_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), real[grid])[1]})())
    got = mod.sum_rows(part, dtype)
    want = part.double().sum(-2)
    assert got.dtype == dtype and got.shape == want.shape and len(launched) == 1
    rtol = 1e-6 if dtype == torch.float32 else {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_zero_centered_gpu_bf16_equals_the_former_composition():
    """H200, Qwen3.5-9B's hidden size: the fused zero-centred norm's bf16 forward equals the composition Qwen3.5's
    layers ran before it (residual add, fp32 copy, rms_norm with the fp32 scale, cast): the residual sum bit for
    bit; the output but for bf16 rounding ties (the two kernels' fp32 rsqrt and products differ in the last bit on
    the GPU, which moves a value sitting half-way between two bf16 numbers: seen on the H200 in 2026-12, a few
    elements one bf16 step apart; the CPU test in fp16 is bit for bit)."""
    x, w, r = (t.detach() for t in _inputs(300, 4096, torch.bfloat16, True, device="cuda"))
    w = w - 1.0
    y, h = rms_norm(x, w, 1e-6, residual=r, zero_centered=True)
    h_ref = x + r
    assert torch.equal(h, h_ref)
    want = rms_norm(h_ref.float(), 1.0 + w.float(), 1e-6)
    apart = y != want.to(torch.bfloat16)
    step = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((y.float() - want).abs() <= step).all()  # within one bf16 step of the fp32 value: a rounding, no more
    assert apart.float().mean().item() <= 1e-3, f"{apart.sum().item()} of {apart.numel()} elements differ"
