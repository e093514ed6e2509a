"""fused_moe_lora (routed experts with PEFT's per-expert LoRA factors, unmerged) on the grouped GEMMs under the
interpreter and on the native loop / masked paths, against a float64 oracle (the delta merged into the weights, as
PEFT's ParamWrapper computes it): output and the gradients of x, the routing weights and the four factors."""

import pytest
import torch

from areno.kernels.moe.fused import fused_moe_reference
from areno.kernels.moe.lora import fused_moe_lora, fused_moe_lora_native


def _problem(T, E, H, I, k, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    used = torch.arange(E - 1)  # the last expert gets no token
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    ids = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(T)]).int()
    w = torch.rand(T, k, generator=g)
    factors = [torch.randn(E * r, H, generator=g) * 0.3, torch.randn(2 * I, r * E, generator=g) * 0.3,
               torch.randn(E * r, I, generator=g) * 0.3, torch.randn(H, r * E, generator=g) * 0.3]
    return x, w13, w2, w, ids, factors


def _merged(a, b, E):
    """PEFT's ParamWrapper delta ``[E, out, in]`` (its einsum over the stacked factors), float64."""
    r = a.shape[0] // E
    return torch.einsum("ore,eri->eoi", b.reshape(b.shape[0], r, E), a.reshape(E, r, a.shape[1]))


def _run(fn, x, w13, w2, w, ids, factors, dy, dtype, scaling=0.5):
    leaves = [t.detach().clone().to(dtype).requires_grad_() for t in (x, w, *factors)]
    x_, w_, a1, b1, a2, b2 = leaves
    if fn is None:  # the oracle
        E = w13.shape[0]
        y = fused_moe_reference(x_, w13.to(dtype) + _merged(a1, b1, E) * scaling,
                                w2.to(dtype) + _merged(a2, b2, E) * scaling, w_, ids)
    else:
        y = fn(x_, w13.to(dtype), w2.to(dtype), w_, ids, (a1, b1, scaling), (a2, b2, scaling))
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("fn", ["triton", "native"])
@pytest.mark.parametrize("T, k, r", [(1, 1, 2), (7, 2, 3), (19, 3, 4)])
def test_output_and_every_gradient_match_float64(triton_kernels, fn, T, k, r):
    problem = _problem(T, 5, 16, 12, k, r)
    dy = torch.randn(T, 16, generator=torch.Generator().manual_seed(1))
    run = fused_moe_lora if fn == "triton" else fused_moe_lora_native
    y, grads = _run(run, *problem, dy, torch.float32)
    y64, grads64 = _run(None, *problem, dy, torch.float64)
    assert _rel(y, y64) < 1e-5
    for got, want in zip(grads, grads64):
        assert _rel(got, want) < 1e-4


def test_without_gradients_the_masked_path_and_the_grouped_one_agree(triton_kernels):
    x, w13, w2, w, ids, (a1, b1, a2, b2) = _problem(6, 5, 16, 12, 2, 3)
    with torch.no_grad():
        grouped = fused_moe_lora(x, w13, w2, w, ids, (a1, b1, 0.5), (a2, b2, 0.5))
        masked = fused_moe_lora_native(x, w13, w2, w, ids, (a1, b1, 0.5), (a2, b2, 0.5))
        only_down = fused_moe_lora(x, w13, w2, w, ids, None, (a2, b2, 0.5))
        reference = fused_moe_reference(x.double(), w13.double(), (w2 + _merged(a2, b2, 5) * 0.5).double(),
                                        w.double(), ids)
    assert _rel(grouped, masked) < 1e-5
    assert _rel(only_down, reference) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 300])
def test_bf16_grouped_path_on_the_gpu_matches_float64(T):
    """H200: bf16 at a 30B-A3B-like expert width (E 32, k 8, r 16), the compiled grouped GEMMs against the float64
    oracle: output and gradients within bf16 rounding."""
    x, w13, w2, w, ids, factors = _problem(T, 32, 512, 256, 8, 16)
    dy = torch.randn(T, 512, generator=torch.Generator().manual_seed(1))
    to = lambda ts: [t.cuda() for t in ts]  # noqa: E731
    y, grads = _run(fused_moe_lora, *to([x, w13, w2, w, ids]), to(factors), dy.cuda(), torch.bfloat16)
    y64, grads64 = _run(None, x, w13, w2, w, ids, factors, dy, torch.float64)
    assert _rel(y.cpu(), y64) < 3e-2
    for got, want in zip(grads, grads64):
        assert _rel(got.cpu(), want) < 5e-2
