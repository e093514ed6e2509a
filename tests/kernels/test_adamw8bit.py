"""adamw8bit_(): the Triton kernel (interpreted on CPU) vs the native reference, the dynamic maps, the quantisation
against a float64 nearest-code search, and 8-bit AdamW against fp32 AdamW over many steps."""

import random

import pytest
import torch

from areno.kernels import adamw8bit as mod
from areno.kernels.adamw import bias_corrections, master_adamw_native
from areno.kernels.adamw8bit import (
    QBLOCK,
    adamw8bit_,
    adamw8bit_native,
    dequantise_native,
    dynamic_map,
    n_blocks,
    quantise_native,
)

HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_dynamic_maps():
    s, u = dynamic_map(True).double(), dynamic_map(False).double()
    for q in (s, u):
        assert q.numel() == 256 and torch.all(q[1:] > q[:-1]) and q[-1] == 1.0 and (q == 0).sum() == 1
    assert s.min() > -1 and torch.equal(s[s < 0].abs().sort().values, s[(s > 0) & (s < 1)])  # symmetric but for +1
    assert u.min() == 0
    # seven decades: the smallest non-zero magnitude is 1e-6 times the midpoint of the first fraction interval
    assert s[s > 0].min() == pytest.approx(0.55e-6, rel=1e-6) and u[u > 0].min() == pytest.approx(0.325e-6, rel=1e-6)
    # per decade: signed 2^i codes, unsigned 2^(i+1) (finer: v has no sign bit)
    for i in range(7):
        lo, hi = 10.0 ** (i - 7), 10.0 ** (i - 6)
        assert int(((s > lo) & (s < hi)).sum()) == 2**i and int(((u > lo) & (u < hi)).sum()) == 2 ** (i + 1)


@pytest.mark.parametrize("signed", [True, False])
def test_quantise_is_nearest_code(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * QBLOCK + 17, generator=g) * torch.logspace(-5, 0, 3 * QBLOCK + 17)
    x = x if signed else x.abs()
    x[QBLOCK : 2 * QBLOCK] = 0  # an all-zero block: absmax 0, every code the map's 0
    qmap = dynamic_map(signed)
    codes, absmax = quantise_native(x, qmap)
    assert codes.dtype == torch.uint8 and absmax.numel() == n_blocks(x.numel()) == 4 and absmax[1] == 0
    xb = torch.nn.functional.pad(x, (0, 4 * QBLOCK - x.numel())).view(4, QBLOCK).double()
    xn = torch.where(absmax[:, None] > 0, xb / absmax[:, None].double().clamp(min=1e-30), 0).reshape(-1)[: x.numel()]
    dist = (qmap.double()[None, :] - xn[:, None]).abs()
    best = dist.min(dim=1).values
    assert torch.all(dist.gather(1, codes.long()[:, None])[:, 0] <= best + 1e-7)
    back = dequantise_native(codes, absmax, qmap)
    assert torch.all(back[QBLOCK : 2 * QBLOCK] == 0)
    # the top decade (above 0.1 of the block's absmax) has 64 signed / 128 unsigned codes: relative error < 7.1%
    big = x.abs() > 0.1 * absmax.repeat_interleave(QBLOCK)[: x.numel()]
    assert big.sum() > 50 and torch.all(((back - x).abs() / x.abs())[big] < 0.071)


def states(n, dtype, seed, grad=True):
    """w, gradient and quantised moments of a state some steps into training."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.1 * torch.logspace(-3, 0, n)
    v = torch.rand(n, generator=g) * 0.01
    (mq, ma), (vq, va) = quantise_native(m, dynamic_map(True)), quantise_native(v, dynamic_map(False))
    grad_t = (torch.randn(n, generator=g) * 3).to(dtype) if grad else None
    return [x.to(DEV) if x is not None else None for x in (w, grad_t, mq, vq, ma, va)]


def scalars(lr=3e-3, t=7.0, scale=2.5, skip=0.0, beta2=HP["beta2"]):
    lr_t, t_t = torch.tensor(lr), torch.tensor(t)
    return [x.to(DEV) for x in (lr_t, *bias_corrections(lr_t, t_t, HP["beta1"], beta2), torch.tensor(scale),
                                torch.tensor(skip))]


# fp16 gradients under the interpreter (its bf16 casts truncate); bf16 and a large odd size on the GPU
@pytest.mark.parametrize("n,dtype,grad", [(1, torch.float16, True), (257, torch.float16, True),
                                          (700, torch.float32, True), (300, torch.float16, False),
                                          pytest.param(1_000_003, torch.bfloat16, True, marks=pytest.mark.gpu)])
def test_kernel_matches_native(n, dtype, grad, monkeypatch, triton_kernels):
    seed = random.randrange(2**31)
    launched = []
    real = mod.adamw8bit_kernel
    monkeypatch.setattr(mod, "adamw8bit_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), real[grid])[1]})())
    got, want = states(n, dtype, seed, grad), states(n, dtype, seed, grad)
    adamw8bit_(*got, *scalars(), **HP)
    adamw8bit_native(*want, *scalars(), **HP)
    assert launched == [(-(-n_blocks(n) // mod.rows_per_program()),)]  # the Triton kernel ran (interpreted here)
    w, _, mq, vq, ma, va = got
    w0, _, mq0, vq0, ma0, va0 = want
    torch.testing.assert_close(w, w0, rtol=1e-6, atol=1e-7, msg=f"seed={seed}")
    torch.testing.assert_close(ma, ma0, rtol=1e-6, atol=0)
    torch.testing.assert_close(va, va0, rtol=1e-6, atol=0)
    # codes: equal but where fp32 rounding of the update puts a value on the other side of a midpoint (one code off)
    for q, q0 in ((mq, mq0), (vq, vq0)):
        diff = (q.int() - q0.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.002, f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(4, 16), (4, 8), (2, 8), (2, 4), (1, 4), (8, 8), (1, 2), (1, 1)])
def test_every_tile_updates_bit_for_bit_as_the_default_one(tile, monkeypatch):
    """The tiles bench/optimizer_8bit.py --tiles sweeps (``adamw8bit.TILE``: absmax blocks a program, warps) change
    where the work runs, not what it computes: master, codes and absmax equal the default tile's bit for bit."""
    n = 1_000_003
    got, want = states(n, torch.bfloat16, 5), states(n, torch.bfloat16, 5)
    adamw8bit_(*want, *scalars(), **HP)
    monkeypatch.setitem(mod.TILE, "rows", tile[0])
    monkeypatch.setitem(mod.TILE, "num_warps", tile[1])
    adamw8bit_(*got, *scalars(), **HP)
    for name, a, b in zip(("w", "grad", "mq", "vq", "ma", "va"), got, want):
        assert torch.equal(a, b), f"tile {tile}: {name} differs from the default tile's"


def _hard_values() -> torch.Tensor:
    """Every code and midpoint of both maps with their fp32 neighbours, decade edges, 0, +-1 and values under the
    smallest code: for the signed map as they are, for the unsigned one their square roots (v = g^2)."""
    out = []
    for signed in (True, False):
        q = dynamic_map(signed)
        mids = (q[1:] + q[:-1]) / 2
        edges = torch.tensor([10.0**-k for k in range(0, 9)] + [0.0, 1e-12, 3e-7, 1.0], dtype=torch.float32)
        vals = torch.cat([q, mids, edges])
        vals = torch.cat([vals, torch.nextafter(vals, torch.tensor(2.0)), torch.nextafter(vals, torch.tensor(-2.0))])
        vals = vals.clamp(-1.0, 1.0) if signed else vals.clamp(0.0, 1.0).sqrt()
        out.append(vals if signed else torch.cat([vals, -vals]))
    return torch.cat(out)


def test_kernel_codes_at_every_code_midpoint_and_neighbour(triton_kernels):
    """The kernel finds each value's code from the map's layout (three comparisons, not a binary search): its codes
    equal the native search's bit for bit where that is hardest (``_hard_values``; midpoints tie to the lower code).
    beta1 = beta2 = 0 make the new moments the gradient (m) and its square (v) exactly, and a 1.0 opening every
    block makes x / absmax = x."""
    vals = _hard_values()
    per = QBLOCK - 1
    vals = torch.cat([vals, vals.new_zeros((-vals.numel()) % per)]).view(-1, per)
    grad = torch.cat([torch.ones(vals.shape[0], 1), vals], 1).reshape(-1).to(DEV)
    n = grad.numel()
    hp = dict(beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
    lr_t, t_t = torch.tensor(1e-3), torch.tensor(1.0)
    sc = [x.to(DEV) for x in (lr_t, *bias_corrections(lr_t, t_t, 0.0, 0.0), torch.tensor(1.0), torch.tensor(0.0))]
    got, want = ([torch.zeros(n, device=DEV), grad, torch.zeros(n, dtype=torch.uint8, device=DEV),
                  torch.zeros(n, dtype=torch.uint8, device=DEV), torch.zeros(n_blocks(n), device=DEV),
                  torch.zeros(n_blocks(n), device=DEV)] for _ in range(2))
    adamw8bit_(*got, *sc, **hp)
    adamw8bit_native(*want, *sc, **hp)
    assert torch.equal(got[4], want[4]) and torch.equal(got[5], want[5]) and bool((got[4] == 1).all())
    for q, q0, name in ((got[2], want[2], "exp_avg"), (got[3], want[3], "exp_avg_sq")):
        bad = (q != q0).nonzero().flatten()
        assert bad.numel() == 0, f"{name}: {bad.numel()} codes differ, e.g. at {grad[bad[:4]].tolist()}"


@pytest.mark.parametrize("fn", [adamw8bit_, adamw8bit_native])
def test_skip_changes_nothing(fn, triton_kernels):
    st = states(300, torch.float16, 1)
    before = [x.clone() for x in st]
    fn(*st, *scalars(skip=1.0), **HP)
    assert all(torch.equal(x, y) for x, y in zip(st, before))


def test_bad_shapes_are_refused():
    w, g, mq, vq, ma, va = states(300, torch.float32, 2)
    with pytest.raises(ValueError, match="uint8"):
        adamw8bit_(w, g, mq.float(), vq, ma, va, *scalars(), **HP)
    with pytest.raises(ValueError, match="256"):
        adamw8bit_(w, g, mq, vq, ma[:1], va, *scalars(), **HP)


@pytest.mark.parametrize("kernels", ["native", pytest.param("triton", marks=pytest.mark.gpu)])
def test_8bit_tracks_fp32_adamw_over_steps(kernels, monkeypatch):
    """200 steps on a noisy quadratic: the 8-bit run's weights stay within a few percent of the distance fp32
    AdamW's travelled, and as near the optimum."""
    monkeypatch.setenv("ARENO_KERNELS", kernels)
    n, steps, hp = 1000, 200, dict(HP, beta2=0.999)
    g = torch.Generator().manual_seed(0)
    target = torch.randn(n, generator=g).to(DEV)
    w0 = torch.zeros(n, device=DEV)
    w8, w32 = w0.clone(), w0.clone()
    m32, v32 = torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)
    mq, vq = torch.zeros(n, dtype=torch.uint8, device=DEV), torch.zeros(n, dtype=torch.uint8, device=DEV)
    ma, va = torch.zeros(n_blocks(n), device=DEV), torch.zeros(n_blocks(n), device=DEV)
    for t in range(1, steps + 1):
        noise = (torch.randn(n, generator=g) * 0.5).to(DEV)
        sc = scalars(lr=1e-2, t=float(t), scale=1.0, beta2=hp["beta2"])
        adamw8bit_(w8, (w8 - target) + noise, mq, vq, ma, va, *sc, **hp)
        master_adamw_native(w32, m32, v32, (w32 - target) + noise, torch.empty(n, device=DEV), *sc, **hp)
    travelled = (w32 - w0).norm()
    assert (w8 - w32).norm() < 0.04 * travelled  # measured 0.028
    assert (w8 - target).norm() < 1.06 * (w32 - target).norm()  # measured 1.04
