"""biased_moe (GPT-OSS's experts: biases, interleaved gate/up, clamped SwiGLU) on the grouped GEMMs under the
interpreter and on the native loop / dense paths, against a float64 oracle: output and all five gradients."""

import pytest
import torch

from areno.kernels.moe.biased import biased_moe, biased_moe_native, biased_moe_reference, clamped_swiglu

ALPHA, LIMIT = 1.702, 0.9  # a limit the random pre-activations cross on both sides


def _problem(T, E, H, I, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    used = torch.arange(E - 1)  # the last expert gets no token
    x = torch.randn(T, H, generator=g)
    gate_up = torch.randn(E, H, 2 * I, generator=g) * H**-0.5
    bias = torch.randn(E, 2 * I, generator=g) * 0.5
    down = torch.randn(E, I, H, generator=g) * I**-0.5
    ids = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(T)]).int()
    w = torch.rand(T, k, generator=g)
    return [x, gate_up, bias, down, w], ids


def _fwd_bwd(fn, leaves, ids, dy, dtype):
    leaves = [t.detach().clone().to(dtype).requires_grad_() for t in leaves]
    y = fn(*leaves, ids, ALPHA, LIMIT)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("fn", ["triton", "native"])
@pytest.mark.parametrize("T, k", [(1, 1), (7, 2), (19, 3)])
def test_output_and_every_gradient_match_float64(triton_kernels, fn, T, k):
    leaves, ids = _problem(T, 5, 16, 12, k)
    dy = torch.randn(T, 16, generator=torch.Generator().manual_seed(1))
    run = biased_moe if fn == "triton" else biased_moe_native
    y, grads = _fwd_bwd(run, leaves, ids, dy, torch.float32)
    y_ref, grads_ref = _fwd_bwd(biased_moe_reference, leaves, ids, dy, torch.float64)
    assert _rel(y, y_ref) < 2e-5
    for name, g, g_ref in zip(("x", "gate_up", "gate_up_bias", "down", "weights"), grads, grads_ref, strict=True):
        assert g.shape == g_ref.shape and _rel(g, g_ref) < 2e-5, (name, _rel(g, g_ref))
    assert grads[1][-1].abs().max() == 0 and grads[3][-1].abs().max() == 0  # the unused expert


def test_no_grad_paths_dense_and_grouped_agree(triton_kernels):
    leaves, ids = _problem(6, 5, 16, 12, 2, seed=3)
    with torch.no_grad():
        want = biased_moe_reference(*[t.double() for t in leaves], ids, ALPHA, LIMIT)
        dense = biased_moe_native(*leaves, ids, ALPHA, LIMIT)  # 12 pairs: every expert masked, no host sync
        grouped = biased_moe(*leaves, ids, ALPHA, LIMIT)
    assert _rel(dense, want) < 2e-6 and _rel(grouped, want) < 2e-6


def test_native_dispatch_runs_the_loop(native_kernels):
    leaves, ids = _problem(4, 5, 16, 12, 2)
    with torch.no_grad():
        assert _rel(biased_moe(*leaves, ids, ALPHA, LIMIT),
                    biased_moe_reference(*[t.double() for t in leaves], ids, ALPHA, LIMIT)) < 2e-6


def test_activation_clamps_gate_above_and_up_both_sides():
    gate_up = torch.tensor([[10.0, 10.0, -10.0, -10.0, 0.5, 0.25]])  # (gate, up) pairs
    out = clamped_swiglu(gate_up, 1.702, 7.0)
    glu = lambda g: g * torch.sigmoid(torch.tensor(1.702 * g))  # noqa: E731
    torch.testing.assert_close(out[0], torch.stack([(7 + 1) * glu(7.0), (-7 + 1) * glu(-10.0), 1.25 * glu(0.5)]))
