"""linear_logprobs_loss: the loss linear in the log-probs, gradients taken in the forward, vs float64."""


import pytest
import torch

from areno.kernels.logprobs import core as ll
from areno.kernels.logprobs.forward import linear_logprobs, reference_linear_logprobs
from areno.kernels.logprobs.loss import linear_logprobs_loss


@pytest.fixture(params=["native", "triton"])
def path(request):
    request.getfixturevalue(f"{request.param}_kernels")
    return request.param


def _inputs(N, H, V, dtype=torch.float32, spread=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * spread * 2 / H**0.5).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.randperm(N, generator=g)[:3]] = -100
    weights = torch.randn(N, generator=g, dtype=torch.float64)
    weights[torch.randperm(N, generator=g)[:4]] = 0.0  # e.g. prompt tokens
    return hidden, weight, targets, weights


def _grads(fn, hidden, weight):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss, lp = fn(h, w)
    (loss * 1.5).backward()  # the incoming gradient scales the stashed ones
    return loss.detach().double(), lp.detach(), h.grad, w.grad


def _reference(hidden, weight, targets, weights, temperature):
    def fn(h, w):
        lp, _ = reference_linear_logprobs(h.double(), w.double(), targets, temperature=temperature)
        return (lp * weights).sum(), lp
    return _grads(fn, hidden, weight)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check(hidden, weight, targets, weights, temperature=1.0, chunk_size=None, tol=2e-5):
    ours = _grads(lambda h, w: linear_logprobs_loss(h, w, targets, weights.float(), temperature=temperature,
                                                    chunk_size=chunk_size), hidden, weight)
    ref = _reference(hidden, weight, targets, weights, temperature)
    loss, lp, dh, dw = ours
    assert lp.dtype == torch.float32 and not lp.requires_grad and (lp[targets < 0] == 0).all()
    assert (lp - ref[1]).abs().max().item() < tol * max(1.0, ref[1].abs().max().item())
    assert abs(loss.item() - ref[0].item()) < tol * max(1.0, ref[1].abs().sum().item())
    assert _rel(dh, ref[2]) < tol, _rel(dh, ref[2])
    assert _rel(dw, ref[3]) < tol, _rel(dw, ref[3])
    assert dh.dtype == hidden.dtype and dw.dtype == weight.dtype


@pytest.mark.parametrize("N,H,V,chunk", [(37, 48, 300, None), (70, 64, 257, 16), (5, 32, 129, 2)])
def test_fp32_vs_float64(path, N, H, V, chunk):
    _check(*_inputs(N, H, V), temperature=0.7, chunk_size=chunk)


def test_targets_far_below_the_max_are_rewritten(triton_kernels, monkeypatch):
    """Rows whose max logit is over Q_EXP_CAP above the target's take the FIX pass: exact either way (with a
    tiny cap nearly every weighted row is rewritten; with wide logits some rows pass the real cap)."""
    hidden, weight, targets, weights = _inputs(33, 32, 200, spread=40.0, seed=1)
    z = hidden @ weight.T
    assert ((z.max(1).values - z.gather(1, targets.clamp(min=0)[:, None])[:, 0]) > ll.Q_EXP_CAP).any()
    _check(hidden, weight, targets, weights, chunk_size=16)
    monkeypatch.setattr(ll, "Q_EXP_CAP", 0.25)
    _check(hidden, weight, targets, weights, chunk_size=16)


def test_matches_linear_logprobs_backward(path):
    """Same log-probs and (to rounding) the same gradients as linear_logprobs with the loss built on its output."""
    hidden, weight, targets, weights = _inputs(40, 32, 150, seed=2)
    ours = _grads(lambda h, w: linear_logprobs_loss(h, w, targets, weights.float()), hidden, weight)

    def plain(h, w):
        lp = linear_logprobs(h, w, targets)
        return (lp * weights.float()).sum(), lp
    theirs = _grads(plain, hidden, weight)
    assert torch.allclose(ours[1], theirs[1], atol=1e-5)
    assert _rel(ours[2], theirs[2]) < 1e-5 and _rel(ours[3], theirs[3]) < 1e-5


@pytest.mark.parametrize("chunk", [None, 7])
def test_a_token_function_vs_float64(path, chunk):
    """token_loss as a callable, nonlinear in each token's log-prob (a clipped-ratio-like term and a square), called
    per chunk of rows: loss, log-probs and gradients as the float64 reference's autograd gives them."""
    hidden, weight, targets, weights = _inputs(45, 40, 230, seed=4)
    old = -torch.rand(45, dtype=torch.float64) * 4
    adv = torch.randn(45, dtype=torch.float64)
    calls = []

    def f(lp, start, end, dtype=None):
        calls.append((start, end))
        ratio = torch.exp(lp - old[start:end].to(lp.dtype))
        pg = torch.maximum(-adv[start:end].to(lp.dtype) * ratio, -adv[start:end].to(lp.dtype) * ratio.clamp(0.8, 1.28))
        return weights[start:end].to(lp.dtype) * (pg + 0.1 * lp.square())

    ours = _grads(lambda h, w: linear_logprobs_loss(h, w, targets, f, temperature=0.9, chunk_size=chunk),
                  hidden, weight)

    def ref_fn(h, w):
        lp, _ = reference_linear_logprobs(h.double(), w.double(), targets, temperature=0.9)
        ok = targets >= 0  # an ignored target's log-prob is 0 and carries no gradient
        return torch.where(ok, f(lp, 0, 45), f(lp.detach(), 0, 45)).sum(), lp
    ref = _grads(ref_fn, hidden, weight)
    assert abs(ours[0].item() - ref[0].item()) < 2e-5 * max(1.0, abs(ref[0].item()))
    assert (ours[1] - ref[1]).abs().max().item() < 2e-5 * max(1.0, ref[1].abs().max().item())
    assert _rel(ours[2], ref[2]) < 2e-5 and _rel(ours[3], ref[3]) < 2e-5
    if chunk and path == "triton":
        assert (0, 7) in calls and (42, 45) in calls  # chunk by chunk


def test_frozen_inputs_and_leading_dims(path):
    hidden, weight, targets, weights = _inputs(24, 32, 130, seed=3)
    h = hidden.view(4, 6, 32).requires_grad_()
    loss, lp = linear_logprobs_loss(h, weight, targets.view(4, 6), weights.float().view(4, 6))
    assert lp.shape == (4, 6)
    loss.backward()
    ref = _reference(hidden, weight, targets, weights, 1.0)
    assert _rel(h.grad.view(24, 32) * 1.5, ref[2]) < 2e-5


def test_rejects_bad_inputs():
    hidden, weight, targets, weights = _inputs(8, 16, 40)
    with pytest.raises(ValueError, match="token_loss weights"):
        linear_logprobs_loss(hidden, weight, targets, weights[:4].float())
    with pytest.raises(ValueError, match="without grad"):
        linear_logprobs_loss(hidden, weight, targets, weights.float().requires_grad_())
    with pytest.raises(ValueError, match="weight tensor or a callable"):
        linear_logprobs_loss(hidden, weight, targets, [1.0] * 8)
    with pytest.raises(ValueError, match="returned"):
        linear_logprobs_loss(hidden, weight, targets, lambda lp, a, b: lp.sum())
    with pytest.raises(ValueError, match="dtypes differ"):
        linear_logprobs_loss(hidden, weight.double(), targets, weights.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,H,V,chunk", [(4096, 1024, 151936, None), (1000, 1024, 32000, 384), (300, 896, 5000, None)])
def test_gpu_bf16_vs_float64(N, H, V, chunk):
    torch.manual_seed(0)
    hidden = torch.randn(N, H, device="cuda").bfloat16()
    weight = (torch.randn(V, H, device="cuda") * 2 / H**0.5).bfloat16()
    targets = torch.randint(0, V, (N,), device="cuda")
    targets[:7] = -100
    weights = -torch.rand(N, device="cuda", dtype=torch.float64) / N
    ours = _grads(lambda h, w: linear_logprobs_loss(h, w, targets, weights.float(), chunk_size=chunk),
                  hidden, weight)
    ref = _reference(hidden, weight, targets, weights, 1.0)
    assert (ours[1] - ref[1]).abs().max().item() < 2e-2
    assert _rel(ours[2], ref[2]) < 1e-2 and _rel(ours[3], ref[3]) < 1e-2
    plain_h = hidden.detach().clone().requires_grad_()
    plain_w = weight.detach().clone().requires_grad_()
    ((linear_logprobs(plain_h, plain_w, targets) * weights.float()).sum() * 1.5).backward()
    # no worse than linear_logprobs' own bf16 backward against the same reference
    assert _rel(ours[2], ref[2]) < 1.5 * _rel(plain_h.grad, ref[2]) + 1e-4
    assert _rel(ours[3], ref[3]) < 1.5 * _rel(plain_w.grad, ref[3]) + 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_token_function_vs_float64():
    """A clipped-ratio token function on the GPU (bf16, 4,096-row chunks over 6,000 rows) against float64."""
    torch.manual_seed(1)
    N, H, V = 6000, 1024, 32000
    hidden = torch.randn(N, H, device="cuda").bfloat16()
    weight = (torch.randn(V, H, device="cuda") * 2 / H**0.5).bfloat16()
    targets = torch.randint(0, V, (N,), device="cuda")
    old = -torch.rand(N, device="cuda", dtype=torch.float64) * 8 - 6
    adv = torch.randn(N, device="cuda", dtype=torch.float64)

    def f(lp, start, end):
        r = torch.exp(lp - old[start:end].to(lp.dtype))
        a = adv[start:end].to(lp.dtype)
        return torch.maximum(-a * r, -a * r.clamp(0.8, 1.28)) / N

    ours = _grads(lambda h, w: linear_logprobs_loss(h, w, targets, f), hidden, weight)
    ref = _grads(lambda h, w: (lambda lp: (f(lp, 0, N).sum(), lp))(
        reference_linear_logprobs(h.double(), w.double(), targets)[0]), hidden, weight)
    assert (ours[1] - ref[1]).abs().max().item() < 2e-2
    assert _rel(ours[2], ref[2]) < 2e-2 and _rel(ours[3], ref[3]) < 2e-2


@pytest.mark.parametrize("n,dtype", [(1, torch.float16), (1000, torch.float16), (4097, torch.float32),
                                     pytest.param(151_936 * 64 + 3, torch.bfloat16, marks=pytest.mark.gpu)])
def test_scale_round_matches_torch(n, dtype, triton_kernels, monkeypatch):
    from areno.kernels.logprobs import loss as mod

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 7).to(dev)
    s = torch.tensor(-0.37, device=dev)
    launched = []
    real = mod.scale_round_kernel
    monkeypatch.setattr(mod, "scale_round_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), real[grid])[1]})())
    out = mod.scale_round(g, s, dtype)
    assert out.dtype == dtype and len(launched) == 1
    assert torch.equal(out, (g.double() * -0.37).float().to(dtype)) or torch.equal(out, (g * s).to(dtype))


def test_q_store_tma_and_pointer_agree(triton_kernels):
    hidden, weight, targets, weights = _inputs(37, 32, 300, seed=5)
    got = {}
    for store in ("tma", "pointer"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, lp = linear_logprobs_loss(h, w, targets, weights.float(), _q_store=store)
        loss.backward()
        got[store] = (loss, lp, h.grad, w.grad)
    for a, b in zip(got["tma"], got["pointer"]):
        assert torch.equal(a, b)  # the same q values, stored two ways
    with pytest.raises(ValueError, match="q_store must be one of"):
        linear_logprobs_loss(hidden, weight, targets, weights.float(), _q_store="bulk")
