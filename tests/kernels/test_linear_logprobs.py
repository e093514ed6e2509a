"""linear_logprobs: Triton (interpreted on CPU) and native paths vs the float64 full-logits reference, fwd + bwd."""


import pytest
import torch

from areno.kernels.logprobs import core as mod
from areno.kernels.logprobs.forward import linear_logprobs, reference_linear_logprobs

# Gradients are compared by relative Frobenius error; values by absolute error (log-probs are O(10)).
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-5, 2e-3), torch.bfloat16: (2e-3, 1e-2)}  # (values, grads)


@pytest.fixture(params=["native", "triton"])
def path(request):
    request.getfixturevalue(f"{request.param}_kernels")
    return request.param


@pytest.fixture
def nan_empty(monkeypatch):
    """Every float buffer the launchers allocate starts as NaN, so an unwritten element fails the test."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(real_empty_like(*a, **k)))


def _inputs(N, H, V, dtype, device="cpu", scale=0.5, n_ignore=3):
    hidden = torch.randn(N, H, device=device).to(dtype)
    weight = (torch.randn(V, H, device=device) * scale / H**0.5 * 4).to(dtype)
    targets = torch.randint(0, V, (N,), device=device)
    targets[torch.randperm(N, device=device)[:n_ignore]] = -100
    return hidden, weight, targets


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run(fn, hidden, weight, targets, g_lp, g_ent, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = fn(h, w, targets, **kw)
    loss = (lp.double() * g_lp).sum() + (0 if g_ent is None else (ent.double() * g_ent).sum())
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _ours(h, w, t, **kw):
    return linear_logprobs(h, w, t, return_entropy=True, **kw)


def _reference(h, w, t, **kw):
    return reference_linear_logprobs(h.double(), w.double(), t, **kw)


def _check(hidden, weight, targets, tol, with_entropy=True, **kw):
    N = targets.numel()
    g_lp = torch.randn(N, dtype=torch.float64, device=hidden.device)
    g_ent = torch.randn(N, dtype=torch.float64, device=hidden.device) if with_entropy else None
    lp, ent, dh, dw = _run(_ours, hidden, weight, targets, g_lp, g_ent, **kw)
    for key in ("chunk_size", "_loads", "_bwd_chunk"):  # linear_logprobs only
        kw.pop(key, None)
    rlp, rent, rdh, rdw = _run(_reference, hidden, weight, targets, g_lp, g_ent, **kw)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert (lp[targets < 0] == 0).all()
    assert (lp - rlp).abs().max().item() < tol[0] * max(1.0, rlp.abs().max().item())
    assert (ent - rent).abs().max().item() < tol[0] * max(1.0, rent.abs().max().item())
    assert _rel(dh, rdh) < tol[1], _rel(dh, rdh)
    assert _rel(dw, rdw) < tol[1], _rel(dw, rdw)
    assert dh.dtype == hidden.dtype and dw.dtype == weight.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_values_entropy_and_grads_vs_float64(path, dtype, nan_empty):
    hidden, weight, targets = _inputs(37, 48, 2053, dtype)
    _check(hidden, weight, targets, TOL[dtype], temperature=0.7)


@pytest.mark.parametrize("loads", ["tma", "pointer"])
def test_flat_loop_forward(triton_kernels, monkeypatch, loads):
    """The forward's single-loop variant (one of the autotuned shapes on CUDA) gives the same values."""
    monkeypatch.setattr(mod, "INTERPRET_FLAT", True)
    hidden, weight, targets = _inputs(37, 40, 1031, torch.float32)
    lp, ent = linear_logprobs(hidden, weight, targets, temperature=0.6, return_entropy=True, _loads=loads)
    rlp, rent = reference_linear_logprobs(hidden.double(), weight.double(), targets, temperature=0.6)
    assert (lp - rlp).abs().max().item() < 2e-5 and (ent - rent).abs().max().item() < 2e-5


def test_pointer_loads_vs_float64(triton_kernels):
    """Masked pointer loads (the path where TMA cannot run), hidden size not a multiple of the K tile."""
    hidden, weight, targets = _inputs(37, 40, 1031, torch.float32)
    assert not mod.options(hidden, weight, True, loads="pointer").tma
    _check(hidden, weight, targets, TOL[torch.float32], temperature=0.7, _loads="pointer")


def test_load_choice(triton_kernels):
    """auto: TMA descriptors where the rows are 16-byte aligned; tma refuses where it cannot run."""
    hidden, weight, _ = _inputs(8, 40, 300, torch.float32)
    assert mod.options(hidden, weight, True).tma and not mod.options(hidden, weight, False).tma
    odd = torch.randn(8, 37)  # 148-byte rows
    assert not mod.options(odd, torch.randn(300, 37), True).tma
    with pytest.raises(RuntimeError, match="loads='tma'"):
        mod.options(odd, torch.randn(300, 37), True, loads="tma")
    w = torch.randn(300, 37) / 8
    targets = torch.randint(0, 300, (8,))
    lp = linear_logprobs(odd, w, targets)  # auto falls back to pointers on its own
    rlp, _ = reference_linear_logprobs(odd.double(), w.double(), targets)
    assert (lp - rlp).abs().max().item() < 2e-5


@pytest.mark.parametrize("key,value", [("loads", "fast"), ("bwd_chunk", 1000), ("bwd_chunk", "1e9")])
def test_invalid_options_refused(path, key, value):
    """An invalid variant fails on every path, naming the keyword."""
    hidden, weight, targets = _inputs(4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=key):
        linear_logprobs(hidden, weight, targets, **{f"_{key}": value})


def test_chunk_plan_evens_vocab_chunks():
    """Vocab chunks of one size (a multiple of 256) within the budget, no small last chunk."""
    rows, cols = mod.chunk_plan(16384, 151936, None, 1 << 28)
    assert rows == 16384 and cols == 15360 and rows * cols <= 1 << 28
    assert 151936 - 9 * cols == 13696  # ten chunks, the last 89% of the others
    assert mod.chunk_plan(16384, 151936, None, 1 << 27) == (16384, 8192)
    assert mod.chunk_plan(100, 5000, None, 1 << 28) == (100, 5000)


def test_native_bf16(native_kernels):
    """bf16 on the native path (the interpreter's bf16 arithmetic is wrong, so the Triton path is GPU-tested)."""
    hidden, weight, targets = _inputs(31, 40, 1201, torch.bfloat16)
    _check(hidden, weight, targets, TOL[torch.bfloat16], temperature=1.1, chunk_size=8)


@pytest.mark.parametrize("chunk_size,budget", [(5, None), (16, 3000)])
def test_chunked_backward(path, chunk_size, budget, monkeypatch):
    """Token chunks (dweight accumulated over them) and vocab chunks give the same gradients."""
    if budget is not None:  # small budget: several vocab chunks of 256 columns per token chunk
        monkeypatch.setattr(mod, "GRAD_CHUNK_ELEMENTS", budget)
        monkeypatch.setattr(mod, "NATIVE_CHUNK_ELEMENTS", budget)
    hidden, weight, targets = _inputs(29, 40, 1031, torch.float32)
    _check(hidden, weight, targets, TOL[torch.float32], temperature=1.3, chunk_size=chunk_size)


def test_ignore_index_without_entropy(path):
    """-100 rows give 0 and no gradient; the logprob-only backward skips the entropy term."""
    hidden, weight, targets = _inputs(23, 32, 777, torch.float32, n_ignore=8)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp = linear_logprobs(h, w, targets)
    g = torch.randn(23)
    (lp * g).sum().backward()
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    rlp, _ = reference_linear_logprobs(h64, w64, targets)
    (rlp * g.double()).sum().backward()
    ignored = targets < 0
    assert (lp[ignored] == 0).all() and (h.grad[ignored] == 0).all()
    assert (lp - rlp).abs().max().item() < 2e-5
    assert _rel(h.grad, h64.grad) < 2e-5 and _rel(w.grad, w64.grad) < 2e-5


def test_leading_dims_and_frozen_hidden(path):
    """[B, T, H] inputs keep their shape; only the requested gradient is produced."""
    hidden, weight, targets = _inputs(2 * 7, 24, 515, torch.float32, n_ignore=0)
    w = weight.clone().requires_grad_()
    lp, ent = linear_logprobs(hidden.view(2, 7, 24), w, targets.view(2, 7), temperature=0.5, return_entropy=True)
    assert lp.shape == (2, 7) and ent.shape == (2, 7)
    ent.sum().backward()
    w64 = weight.double().requires_grad_()
    rlp, rent = reference_linear_logprobs(hidden.double(), w64, targets, temperature=0.5)
    rent.sum().backward()
    assert (lp.reshape(-1) - rlp).abs().max().item() < 2e-5
    assert _rel(w.grad, w64.grad) < 2e-5


def test_native_float64_is_exact(native_kernels):
    """The native path keeps float64 inputs in float64: it agrees with the reference to rounding."""
    hidden, weight, targets = _inputs(11, 16, 301, torch.float64)
    lp, ent = linear_logprobs(hidden, weight, targets, temperature=0.9, return_entropy=True)
    rlp, rent = reference_linear_logprobs(hidden, weight, targets, temperature=0.9)
    assert lp.dtype == torch.float64
    assert (lp - rlp).abs().max().item() < 1e-12 and (ent - rent).abs().max().item() < 1e-12


def test_no_tokens(native_kernels):
    """An empty batch gives empty results and zero (not uninitialised) gradients."""
    w = torch.randn(50, 8, requires_grad=True)
    h = torch.randn(0, 8, requires_grad=True)
    lp, ent = linear_logprobs(h, w, torch.zeros(0, dtype=torch.int64), return_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert (w.grad == 0).all() and h.grad.shape == (0, 8)


def test_rejects_bad_shapes():
    hidden, weight, targets = _inputs(4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        linear_logprobs(hidden, weight[:, :4], targets)
    with pytest.raises(ValueError, match="targets"):
        linear_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(hidden, weight, targets, temperature=0.0)


# ---- GPU: bf16 at the real shape (16k tokens, vocab 151,936) -----------------------------------------------------


def _reference_chunked(hidden, weight, targets, g_lp, g_ent, temperature, rows=1024):
    """Float64 reference with autograd, 1024 tokens at a time so the [N, V] float64 logits never exist whole."""
    w = weight.double().requires_grad_()
    lps, ents, dhs = [], [], []
    for r0 in range(0, hidden.shape[0], rows):
        h = hidden[r0 : r0 + rows].double().requires_grad_()
        lp, ent = reference_linear_logprobs(h, w, targets[r0 : r0 + rows], temperature=temperature)
        ((lp * g_lp[r0 : r0 + rows]).sum() + (ent * g_ent[r0 : r0 + rows]).sum()).backward()
        lps.append(lp.detach())
        ents.append(ent.detach())
        dhs.append(h.grad)
    return torch.cat(lps), torch.cat(ents), torch.cat(dhs), w.grad


_GPU_VARIANTS = [  # (H, loads, backward chunk elements; None = default)
    (1024, "auto", None), (4096, "auto", None), (1024, "pointer", None), (1024, "tma", 1 << 27),
    (1024, "pointer", 1 << 26),
]


@pytest.mark.gpu
@pytest.mark.parametrize("H,loads,chunk", _GPU_VARIANTS)
def test_gpu_bf16_real_shape(H, loads, chunk, triton_kernels):
    """Every backward chunking and load path against float64 at the K2 shape (10-20 vocab chunks)."""
    torch.manual_seed(H)
    N, V = 16384, 151936
    hidden, weight, targets = _inputs(N, H, V, torch.bfloat16, device="cuda", n_ignore=100)
    g_lp = torch.randn(N, dtype=torch.float64, device="cuda") / N
    g_ent = torch.randn(N, dtype=torch.float64, device="cuda") / N
    lp, ent, dh, dw = _run(_ours, hidden, weight, targets, g_lp, g_ent, temperature=0.9, _loads=loads,
                           _bwd_chunk=chunk)
    rlp, rent, rdh, rdw = _reference_chunked(hidden, weight, targets, g_lp, g_ent, 0.9)
    assert (lp - rlp).abs().max().item() < 2e-3 and (ent - rent).abs().max().item() < 2e-3
    assert _rel(dh, rdh) < 1e-2 and _rel(dw, rdw) < 1e-2
    assert (lp[targets < 0] == 0).all() and torch.isfinite(dw).all()


@pytest.mark.gpu
@pytest.mark.parametrize("loads", ["auto", "pointer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_small_shapes(dtype, loads, triton_kernels):
    hidden, weight, targets = _inputs(300, 96, 5003, dtype, device="cuda")
    _check(hidden, weight, targets, TOL[dtype], temperature=0.8, _loads=loads)


@pytest.mark.gpu
def test_gpu_chunked_backward_in_cuda_graph(triton_kernels):
    """The chunked backward captures into a CUDA graph (as the train-step graphs do) and replays the eager
    gradients: 64 chunks, so the buffer reuse runs many times."""
    hidden, weight, targets = _inputs(512, 128, 5003, torch.bfloat16, device="cuda")
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    g = torch.randn(512, device="cuda")

    def step():
        lp, ent = linear_logprobs(h, w, targets, return_entropy=True, _bwd_chunk=1 << 16)
        ((lp * g).sum() + ent.sum()).backward()

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(2):
            h.grad = w.grad = None
            step()
    torch.cuda.current_stream().wait_stream(warm)
    eager_h, eager_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(h.grad, eager_h) < 1e-3 and _rel(w.grad, eager_w) < 1e-3
