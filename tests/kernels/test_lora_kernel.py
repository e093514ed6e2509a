"""Grouped LoRA (lora_add): Triton (interpreted on CPU) and native vs a float64 per-row reference, odd shapes, mixed
and absent adapter indices, a column slice of a wider output."""

import pytest
import torch

from areno.kernels.lora import lora_add, lora_add_reference

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2)}


def _case(m, k, n, slots, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    a = (torch.randn(slots, r, k, generator=g) / k**0.5).to(dtype)
    b = (torch.randn(slots, n, r, generator=g) / r**0.5).to(dtype)
    scale = torch.rand(slots, generator=g) + 0.5
    idx = torch.randint(-1, slots, (m,), generator=g, dtype=torch.int32)
    y = torch.randn(m, n, generator=g).to(dtype)
    return y, x, a, b, scale, idx


def _float64(y, x, a, b, scale, idx):
    """Row by row in float64: the oracle."""
    out = y.double().clone()
    for i, s in enumerate(idx.tolist()):
        if s >= 0:
            out[i] += scale[s].double() * (x[i].double() @ a[s].double().t()) @ b[s].double().t()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 24, 40, 1, 8), (37, 70, 33, 3, 5), (70, 130, 96, 4, 16)])
def test_triton_and_native_match_float64(triton_kernels, dtype, shape):
    m, k, n, slots, r = shape
    y, x, a, b, scale, idx = _case(m, k, n, slots, r, dtype)
    want = _float64(y, x, a, b, scale, idx)
    got = lora_add(y.clone(), x, a, b, scale, idx)
    native = lora_add_reference(y.clone(), x, a, b, scale, idx)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    torch.testing.assert_close(native.double(), want, rtol=rtol, atol=atol)
    untouched = idx < 0
    assert torch.equal(got[untouched], y[untouched])  # rows without an adapter are left exactly as they were


def test_column_slice_of_a_fused_output(triton_kernels):
    """A fused projection's rows [offset, offset + n) of a wider output: only they change."""
    y, x, a, b, scale, idx = _case(19, 48, 24, 2, 4, torch.float32, seed=3)
    wide = torch.randn(19, 80)
    before = wide.clone()
    lora_add(wide[:, 30:54], x, a, b, scale, idx)
    want = _float64(before[:, 30:54], x, a, b, scale, idx)
    torch.testing.assert_close(wide[:, 30:54].double(), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(wide[:, :30], before[:, :30]) and torch.equal(wide[:, 54:], before[:, 54:])


def test_zero_padded_rank_equals_the_lower_rank(triton_kernels):
    """A rank-3 adapter stored in rank-8 slots (zero padding) gives the rank-3 result."""
    y, x, a, b, scale, idx = _case(9, 32, 16, 2, 3, torch.float32, seed=5)
    a8 = torch.zeros(2, 8, 32)
    b8 = torch.zeros(2, 16, 8)
    a8[:, :3], b8[:, :, :3] = a, b
    torch.testing.assert_close(lora_add(y.clone(), x, a8, b8, scale, idx), lora_add(y.clone(), x, a, b, scale, idx))


def test_bad_shapes_are_refused():
    y, x, a, b, scale, idx = _case(4, 8, 6, 2, 2, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        lora_add(y, x, a[:, :, :4], b, scale, idx)
    with pytest.raises(ValueError, match="need"):
        lora_add(y, x, a, b, scale, idx[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_float64(dtype):
    m, k, n, slots, r = 500, 1024, 3072, 4, 16
    y, x, a, b, scale, idx = (t.cuda() for t in _case(m, k, n, slots, r, dtype))
    got = lora_add(y.clone(), x, a, b, scale, idx)
    want = _float64(*(t.cpu() for t in (y, x, a, b, scale, idx)))
    torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=3e-2)
