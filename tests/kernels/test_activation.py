"""silu_and_mul: Triton (interpreted on CPU) vs native vs a float64 reference, forward and gradient."""

import pytest
import torch

from areno.kernels import activation as mod
from areno.kernels.activation import silu_and_mul, silu_and_mul_native

# (rtol, atol) against float64. The forward rounds silu(g) and then the product (two roundings of 2^-11 in fp16,
# 2^-8 in bf16); the gradient is computed in fp32 from rounded inputs and rounded once.
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (2.5e-3, 1e-4), torch.bfloat16: (2e-2, 1e-3)}


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


def _check(x, dtype):
    """x is a leaf (or a view of one) that requires grad; checks y and dx against float64 and against native."""
    leaf = x if x.is_leaf else x._base
    y = silu_and_mul(x)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], x.shape[-1] // 2)
    dy = torch.randn_like(y)
    (dleaf,) = torch.autograd.grad(y, [leaf], dy)
    leaf64 = leaf.detach().double().requires_grad_()
    x64 = leaf64 if x.is_leaf else leaf64.as_strided(x.shape, x.stride(), x.storage_offset())
    y64 = silu_and_mul_native(x64)
    (dleaf64,) = torch.autograd.grad(y64, [leaf64], dy.double())
    _close(y, y64, TOL[dtype])
    # Hugging Face's act_fn(gate) * up in the same dtype: the same two roundings, so within an ulp.
    ulp = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    _close(y, silu_and_mul_native(x.detach()), (2 * ulp, 1e-6))
    _close(dleaf, dleaf64, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 80), (7, 1000), (127, 96), (129, 80), (3, 1500)])
def test_silu_and_mul_triton_matches_references(triton_kernels, nan_empty, rows, inter, dtype):
    x = torch.randn(rows, 2 * inter, dtype=dtype) * 3
    x[0, :4] = torch.tensor([-60.0, 60.0, 0.0, -0.0])  # saturated sigmoid, both signs, and zero
    _check(x.requires_grad_(), dtype)


def test_leading_shape_and_strided_rows(triton_kernels, nan_empty):
    _check(torch.randn(3, 5, 2 * 48, requires_grad=True), torch.float32)
    wide = torch.randn(9, 2 * 40 + 16, requires_grad=True)
    _check(wide[:, 8 : 8 + 2 * 40], torch.float32)  # rows with a stride larger than 2I


def test_native_dispatch_does_not_launch_triton(native_kernels, monkeypatch):
    monkeypatch.setattr(mod.SiluAndMulFunction, "apply", lambda *a: pytest.fail("Triton path used under native"))
    x = torch.randn(4, 64)
    _close(silu_and_mul(x), torch.nn.functional.silu(x[:, :32]) * x[:, 32:], TOL[torch.float32])


def test_launcher_rejects_odd_width():
    with pytest.raises(AssertionError, match="2 \\* I"):
        mod.silu_and_mul_fwd(torch.randn(4, 7))


# ---- GPU: bf16 at real sizes -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows,inter", [(16384, 3072), (4097, 768), (33, 11008)])
def test_silu_and_mul_gpu_bf16(rows, inter):
    x = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    _check(x.requires_grad_(), torch.bfloat16)


@pytest.mark.gpu
def test_silu_and_mul_cuda_graph_replay():
    x = torch.randn(64, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        silu_and_mul(x)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = silu_and_mul(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    _close(y, silu_and_mul_native(x), TOL[torch.bfloat16])
