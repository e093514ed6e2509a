"""master_adamw_(): the Triton kernel (interpreted on CPU) vs the native reference vs float64 AdamW math."""

import random

import pytest
import torch

from areno.kernels import adamw as mod
from areno.kernels.adamw import bias_corrections, master_adamw_, master_adamw_native

HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def state(n, dtype, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    grad_t = (torch.randn(n, generator=g) * 3).to(dtype) if grad else None
    return w, m, v, grad_t, torch.empty(n, dtype=dtype)


def float64_adamw(w, m, v, grad, lr, t, scale, beta1, beta2, eps, weight_decay):
    w, m, v = (x.double() for x in (w, m, v))
    g = torch.zeros_like(w) if grad is None else grad.double() / scale
    w = w * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    w = w - lr / (1 - beta1**t) * m / (v.sqrt() / (1 - beta2**t) ** 0.5 + eps)
    return w, m, v


# fp16 parameters under the interpreter (its bf16 casts truncate); bf16 on the GPU
@pytest.mark.parametrize("n,dtype,grad", [(1, torch.float16, True), (130, torch.float16, True),
                                          (63, torch.float16, True), (200, torch.float16, False),
                                          pytest.param(300_001, torch.bfloat16, True, marks=pytest.mark.gpu)])
def test_kernel_matches_float64_and_native(n, dtype, grad, monkeypatch, triton_kernels):
    seed = random.randrange(2**31)
    lr, t, scale = torch.tensor(3e-3), torch.tensor(7.0), torch.tensor(2.5)
    step_size, bc2 = bias_corrections(lr, t, HP["beta1"], HP["beta2"])
    skip = torch.zeros(())
    want = float64_adamw(*state(n, dtype, seed, grad)[:4], 3e-3, 7, 2.5, **HP)
    launched = []
    real = mod._master_adamw_kernel
    monkeypatch.setattr(mod, "_master_adamw_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), real[grid])[1]})())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lr, step_size, bc2, scale, skip = (x.to(dev) for x in (lr, step_size, bc2, scale, skip))
    want = [x.to(dev) for x in want]
    for fn in (master_adamw_, master_adamw_native):
        w, m, v, g, p = (x.to(dev) if x is not None else None for x in state(n, dtype, seed, grad))
        fn(w, m, v, g, p, lr, step_size, bc2, scale, skip, **HP)
        for name, got, ref in zip("wmv", (w, m, v), want):
            torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=2e-7, msg=f"{fn.__name__} {name} seed={seed}")
        assert torch.equal(p, w.to(dtype)), f"{fn.__name__}: the parameter is the rounded master"
    assert len(launched) == 1  # the first call ran the Triton kernel (interpreted here)


@pytest.mark.parametrize("fn", [master_adamw_, master_adamw_native])
def test_skip_changes_nothing(fn, triton_kernels):
    w, m, v, g, p = state(77, torch.float16, 1)
    p.copy_(w)
    before = [x.clone() for x in (w, m, v, p)]
    lr, t = torch.tensor(1e-2), torch.tensor(3.0)
    fn(w, m, v, g, p, lr, *bias_corrections(lr, t, 0.9, 0.95), torch.tensor(1.0), torch.ones(()), **HP)
    for x, y in zip((w, m, v, p), before):
        assert torch.equal(x, y)
