"""Short causal depthwise conv: Triton (interpreted on CPU) and native vs a float64 reference (F.conv1d per sequence
with the state prepended), forward and every gradient; the decode update vs the full forward, token by token."""

import pytest
import torch
import torch.nn.functional as F

from areno.kernels.linear_attn.short_conv import causal_conv1d, causal_conv1d_native, causal_conv1d_update


def _inputs(lens, D, W, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = torch.randn(T, D, generator=gen).to(device, dtype)
    w = torch.randn(D, W, generator=gen).to(device)
    b = torch.randn(D, generator=gen).to(device)
    s0 = torch.randn(len(lens), D, W - 1, generator=gen).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return x, w, b, s0, cu


def _oracle(x, w, b, s0, cu, activation):
    """Float64, written independently of the kernels: one F.conv1d with left padding per sequence."""
    ys, finals = [], []
    W = w.shape[1]
    for n in range(len(cu) - 1):
        xs = x[cu[n]:cu[n + 1]].double().t()
        full = torch.cat([s0[n].double(), xs], 1)
        y = F.conv1d(full[None], w.double()[:, None], b.double(), groups=x.shape[1])[0].t()
        ys.append(F.silu(y) if activation == "silu" else y)
        finals.append(full[:, -(W - 1):])
    return torch.cat(ys), torch.stack(finals)


def test_native_matches_oracle():
    x, w, b, s0, cu = _inputs([3, 1, 12], 5, 4)
    y, fin = causal_conv1d_native(x, w, b, cu_seqlens=cu, initial_state=s0, output_final_state=True)
    y_ref, fin_ref = _oracle(x, w, b, s0, cu, "silu")
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin.double(), fin_ref)


@pytest.fixture(params=["native", "triton"])
def kernels(request, monkeypatch):
    monkeypatch.setenv("ARENO_KERNELS", request.param)
    return request.param


@pytest.mark.parametrize("activation", ["silu", None])
def test_public_matches_oracle_with_grads(kernels, activation):
    """Sequences shorter than the state (1 < W-1), several packed, initial and final states, every gradient."""
    x, w, b, s0, cu = _inputs([3, 1, 12, 6], 24, 4)
    ts = [t.clone().requires_grad_() for t in (x, w, b, s0)]
    y, fin = causal_conv1d(ts[0], ts[1], ts[2], activation=activation, cu_seqlens=cu, initial_state=ts[3],
                           output_final_state=True)
    dy, dfin = torch.randn_like(y), torch.randn_like(fin)
    grads = torch.autograd.grad((y, fin), ts, (dy, dfin))
    t64 = [t.detach().double().requires_grad_() for t in (x, w, b, s0)]
    y_ref, fin_ref = _oracle(*t64, cu, activation)
    grads_ref = torch.autograd.grad((y_ref, fin_ref), t64, (dy.double(), dfin.double()))
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin.double(), fin_ref)
    for name, g, g_ref in zip(["x", "weight", "bias", "initial_state"], grads, grads_ref):
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_update_follows_forward(kernels):
    lens, D, W = [5, 2, 7], 24, 4
    x, w, b, s0, cu = _inputs(lens, D, W)
    y_full, fin = causal_conv1d(x, w, b, cu_seqlens=cu, initial_state=s0, output_final_state=True)
    pool = torch.randn(5, D, W - 1)
    slots = [3, -1, 0, 4]
    seqs = [0, None, 1, 2]
    pool[3], pool[0], pool[4] = s0
    untouched = pool[1:3].clone()
    starts = cu[:-1].tolist()
    for step in range(max(lens)):
        rows = [starts[n] + min(step, lens[n] - 1) if n is not None else 0 for n in seqs]
        idx = torch.tensor([s if n is not None and step < lens[n] else -1 for s, n in zip(slots, seqs)])
        y = causal_conv1d_update(x[rows], pool, w, b, state_indices=idx)
        for i in range(len(seqs)):
            if idx[i] < 0:
                assert (y[i] == 0).all()
            else:
                torch.testing.assert_close(y[i], y_full[rows[i]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[[3, 0, 4]], fin)
    assert torch.equal(pool[1:3], untouched)
    st = s0[:1].clone()  # no pool: [B, D, W-1] updated in place
    for t in range(lens[0]):
        y = causal_conv1d_update(x[t:t + 1], st, w, b)
        torch.testing.assert_close(y[0], y_full[t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, fin[:1])


def test_rejects_bad_arguments():
    x, w, b, s0, cu = _inputs([4], 6, 4)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, w, initial_state=s0[:, :, :2])


@pytest.mark.gpu
def test_triton_gpu_bf16(monkeypatch):
    """KDA's conv width (4) over q|k|v channels (3 x 16 heads x 128), packed odd lengths, fp32 weights as the model
    keeps them, bf16 activations: forward and gradients against the float64 oracle."""
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    x, w, b, s0, cu = _inputs([1000, 3, 2049, 500], 6144, 4, dtype=torch.bfloat16, device="cuda")
    ts = [t.clone().requires_grad_() for t in (x, w, b, s0)]
    y, fin = causal_conv1d(*ts[:3], cu_seqlens=cu, initial_state=ts[3], output_final_state=True)
    dy, dfin = torch.randn_like(y), torch.randn_like(fin)
    grads = torch.autograd.grad((y, fin), ts, (dy, dfin))
    t64 = [t.detach().double().requires_grad_() for t in (x, w, b, s0)]
    y_ref, fin_ref = _oracle(*t64, cu, "silu")
    grads_ref = torch.autograd.grad((y_ref, fin_ref), t64, (dy.double(), dfin.double()))
    torch.testing.assert_close(y.double(), y_ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(fin.double(), fin_ref)
    for name, g, g_ref in zip(["x", "weight", "bias", "initial_state"], grads, grads_ref):
        scale = g_ref.abs().max().item()
        torch.testing.assert_close(g.double(), g_ref, rtol=2e-2, atol=2e-2 * max(scale, 1.0), msg=f"d{name}")
