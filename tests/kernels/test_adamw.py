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
    real = mod.master_adamw_kernel
    monkeypatch.setattr(mod, "master_adamw_kernel", type("K", (), {
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


def _bucket_entries(sizes, dtype, seed, dev, missing=(), shift=0):
    """(w, m, v, grad, param) slices of one fp32 storage, as MasterAdamW lays a bucket out; ``shift`` moves every
    slice by that many elements (4 bytes each: a shift of 1 misaligns them for the vector launch)."""
    n = -(-(sum(sizes) + shift) // 4) * 4  # the master, m and v thirds each start 16-byte aligned
    g = torch.Generator().manual_seed(seed)
    storage = torch.cat([torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1,
                         torch.rand(n, generator=g) * 0.01]).to(dev)
    w, m, v = storage.view(3, n).unbind(0)
    entries, off = [], shift
    for i, s in enumerate(sizes):
        grad = None if i in missing else (torch.randn(s, generator=g) * 3).to(dtype).to(dev)
        entries.append((w[off : off + s], m[off : off + s], v[off : off + s], grad, torch.empty(s, dtype=dtype,
                                                                                               device=dev)))
        off += s
    return entries


MULTI_CASES = [((64, 132, 4, 256, 61), torch.float16, (), 0), ((40, 24, 100), torch.float16, (1,), 0),
               ((33, 64), torch.float16, (), 1),  # misaligned slices: one by one, as master_adamw_
               pytest.param((300_000, 4096, 16, 1 << 20, 17), torch.bfloat16, (2,), 0, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("sizes,dtype,missing,shift", MULTI_CASES)
def test_multi_tensor_update_matches_float64(sizes, dtype, missing, shift, monkeypatch, triton_kernels):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    seed = random.randrange(2**31)
    lr, t, scale = torch.tensor(3e-3), torch.tensor(7.0), torch.tensor(2.5)
    step_size, bc2 = bias_corrections(lr, t, HP["beta1"], HP["beta2"])
    lr, step_size, bc2, scale, skip = (x.to(dev) for x in (lr, step_size, bc2, scale, torch.zeros(())))
    entries = _bucket_entries(sizes, dtype, seed, dev, missing, shift)
    want = [float64_adamw(w, m, v, g, 3e-3, 7, 2.5, **HP) for w, m, v, g, _ in entries]
    launched = []
    for name in ("multi_adamw_kernel", "master_adamw_kernel"):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, type("K", (), {
            "__getitem__": lambda self, grid, real=real, name=name: (launched.append(name), real[grid])[1]})())
    plan = mod.AdamwPlan(entries)
    mod.master_adamw_multi_(entries, lr, step_size, bc2, scale, skip, plan=plan, **HP)
    for i, ((w, m, v, _, p), ref) in enumerate(zip(entries, want)):
        for name, got, r in zip("wmv", (w, m, v), ref):
            torch.testing.assert_close(got.double(), r, rtol=2e-6, atol=2e-7, msg=f"entry {i} {name} seed={seed}")
        assert torch.equal(p, w.to(dtype)), f"entry {i}: the parameter is the rounded master"
    vector = 0 if shift else len(sizes) - len(missing)  # entries in the one multi-tensor launch
    assert launched.count("multi_adamw_kernel") == (1 if vector else 0)
    assert launched.count("master_adamw_kernel") == len(sizes) - vector


def test_multi_tensor_skip_and_plan_for_other_tensors(triton_kernels):
    entries = _bucket_entries((64, 100), torch.float16, 3, "cpu")
    before = [x.clone() for e in entries for x in (e[0], e[1], e[2])]
    lr, t = torch.tensor(1e-2), torch.tensor(3.0)
    sc = (lr, *bias_corrections(lr, t, 0.9, 0.95), torch.tensor(1.0))
    mod.master_adamw_multi_(entries, *sc, torch.ones(()), **HP)  # skipped: nothing moves
    assert all(torch.equal(x, y) for x, y in zip([x for e in entries for x in e[:3]], before))
    stale = mod.AdamwPlan(_bucket_entries((64, 100), torch.float16, 4, "cpu"))  # other tensors' addresses
    mod.master_adamw_multi_(entries, *sc, torch.zeros(()), plan=stale, **HP)  # rebuilt, not misapplied
    want = float64_adamw(*(x.double() for x in before[:3]), entries[0][3], 1e-2, 3, 1.0, **HP)
    torch.testing.assert_close(entries[0][0].double(), want[0], rtol=2e-6, atol=2e-7)


SUMSQ_CASES = [((1, 63, 4096, 300), torch.float16), ((5, 17), torch.float32),
               pytest.param((151_936 * 8, 3, 1 << 20), torch.bfloat16, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("sizes,dtype", SUMSQ_CASES)
def test_grad_sumsq_matches_float64(sizes, dtype, monkeypatch, triton_kernels):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(random.randrange(2**31))
    tensors = [(torch.randn(s, generator=g) * 2).to(dtype).to(dev) for s in sizes]
    tensors.append(torch.randn(9, generator=g).to(dev)[1:])  # fp32, misaligned: torch's norm path
    launched = []
    real = mod.multi_sumsq_kernel
    monkeypatch.setattr(mod, "multi_sumsq_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), real[grid])[1]})())
    got = mod.grad_sumsq(tensors, mod.SumsqPlan(tensors))
    want = sum((x.double() ** 2).sum() for x in tensors)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert len(launched) == 1  # one launch for the aligned tensors; the misaligned one through torch's norm
