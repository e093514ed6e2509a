"""sample: chi-square distribution, min-p/top-k/top-p support, seeding, greedy, logprobs; Triton (interpreted),
native."""

import math

import pytest
import torch

from areno.kernels.logprobs.forward import linear_logprobs
from areno.kernels.sampler import sample


@pytest.fixture(params=["native", "triton"])
def path(request):
    request.getfixturevalue(f"{request.param}_kernels")
    return request.param


def _seeds(B, device="cpu"):
    return torch.randint(-(2**62), 2**62, (B,), device=device), torch.randint(0, 2**40, (B,), device=device)


def _kept_set(z, k, p, min_p=0.0):
    """Reference kept set of one row of tempered logits (float64): min-p and top-k, then top-p of the renormalised
    rest."""
    order = z.double().argsort(descending=True)
    n = len(order) if k <= 0 or k >= len(order) else k
    cand = order[:n]
    probs = torch.softmax(z.double(), 0)
    cand = cand[probs[cand] >= min_p * probs.max()]
    if p < 1:
        cum = torch.softmax(z.double()[cand], 0).cumsum(0)
        cand = cand[: int((cum < p).sum()) + 1]
    keep = torch.zeros(len(z), dtype=torch.bool)
    keep[cand] = True
    return keep


def _p_between(z, k, i):
    """A top-p value halfway between the (renormalised top-k) cumulative masses i and i+1: keeps exactly i+1 tokens."""
    cum = torch.softmax(z.double().sort(descending=True).values[:k], 0).cumsum(0)
    return float((cum[i] + cum[i + 1]) / 2)


def _assert_distribution(tokens, probs):
    """Chi-square goodness of fit at alpha = 1e-6 (bins expecting < 5 pooled); zero-probability tokens never drawn."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was drawn"
    expected = probs.double() * n
    small = (expected < 5) & (probs > 0)
    obs = torch.cat([counts[~small & (probs > 0)], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small & (probs > 0)], expected[small].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    df = obs.numel() - 1
    if df == 0:  # one token kept (top-p after min-p can leave one): every draw is it, checked above
        return
    z = 4.753  # one-sided normal quantile of 1e-6; Wilson-Hilferty for the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f} (df {df})"


def test_distribution_plain(path):
    V, B, T = 23, 3000, 0.9
    logits = torch.randn(V) * 1.5
    tokens, _ = sample(logits.expand(B, V), temperature=T, seeds=_seeds(B)[0], offsets=_seeds(B)[1])
    _assert_distribution(tokens, torch.softmax(logits.double() / T, 0))


def test_distribution_mixed_batch(path):
    """Rows with different temperature / top-k / top-p / greedy settings in one batch each follow their own law."""
    V, n = 24, 900
    logits = torch.randn(V) * 1.5
    groups = [  # temperature, top_k, top_p
        (1.0, 0, 1.0),
        (0.6, 5, 1.0),
        (1.4, 0, _p_between(logits / 1.4, V, 5)),
        (0.8, 9, _p_between(logits / 0.8, 9, 3)),
        (0.0, 3, 0.5),
    ]
    temp = torch.tensor([g[0] for g in groups]).repeat_interleave(n)
    top_k = torch.tensor([g[1] for g in groups]).repeat_interleave(n)
    top_p = torch.tensor([g[2] for g in groups]).repeat_interleave(n)
    seeds, offsets = _seeds(len(temp))
    tokens, logprobs = sample(logits.expand(len(temp), V), temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds,
                              offsets=offsets)  # fmt: skip
    for i, (t, k, p) in enumerate(groups):
        got = tokens[i * n : (i + 1) * n]
        t_eff = t if t > 0 else 1.0
        logp = torch.log_softmax(logits.double() / t_eff, 0)
        torch.testing.assert_close(logprobs[i * n : (i + 1) * n].double(), logp[got], rtol=0, atol=1e-5)
        if t == 0:
            assert (got == logits.argmax()).all()
            continue
        keep = _kept_set(logits / t, k, p)
        probs = torch.where(keep, torch.softmax(logits.double() / t, 0), 0.0)
        _assert_distribution(got, probs / probs.sum())


def _min_p_between(z, i):
    """A min-p value halfway between the i-th and (i+1)-th largest probability ratios to the top: keeps i+1 tokens."""
    r = torch.softmax(z.double(), 0).sort(descending=True).values
    return float((r[i] + r[i + 1]) / (2 * r[0]))


def test_min_p_distribution(path):
    """min-p keeps the tokens with probability >= min_p * the largest (after temperature), alone and before top-p."""
    V, n = 24, 900
    logits = torch.randn(V) * 1.5
    groups = [(1.0, _min_p_between(logits, 4), 0, 1.0), (0.7, _min_p_between(logits / 0.7, 7), 6, 1.0),
              (1.3, _min_p_between(logits / 1.3, 9), 0, 0.6)]  # temperature, min_p, top_k, top_p
    rows = lambda i: torch.tensor([g[i] for g in groups]).repeat_interleave(n)  # noqa: E731
    seeds, offsets = _seeds(n * len(groups))
    tokens, _ = sample(logits.expand(n * len(groups), V), temperature=rows(0), min_p=rows(1), top_k=rows(2),
                       top_p=rows(3), seeds=seeds, offsets=offsets)  # fmt: skip
    sizes = []
    for i, (t, mp, k, p) in enumerate(groups):
        keep = _kept_set(logits / t, k, p, mp)
        sizes.append(int(keep.sum()))
        probs = torch.where(keep, torch.softmax(logits.double() / t, 0), 0.0)
        _assert_distribution(tokens[i * n : (i + 1) * n], probs / probs.sum())
    assert sizes[:2] == [5, 6] and sizes[2] <= 10  # min-p alone; then top-k cuts deeper; top-p after min-p


def test_support_random_rows(path):
    """Per-row random logits, k, p, temperature: every token lies in its row's top-k / top-p set."""
    B, V = 96, 301
    logits = torch.randn(B, V) * 2
    temp = torch.rand(B) + 0.3
    top_k = torch.randint(-1, 30, (B,))
    top_p = torch.where(torch.rand(B) < 0.3, 1.0, torch.rand(B) * 0.9 + 0.05)
    tokens, _ = sample(logits, temperature=temp, top_k=top_k, top_p=top_p, seeds=_seeds(B)[0], offsets=_seeds(B)[1])
    for b in range(B):
        z = logits[b] * (1.0 / temp[b])  # the same fp32 values the sampler compares
        assert _kept_set(z, int(top_k[b]), float(top_p[b]))[tokens[b]], b


def test_ties_at_the_top_k_boundary_are_kept(path):
    V, B = 40, 600
    logits = torch.full((V,), -3.0)
    logits[:5] = torch.tensor([4.0, 2.0, 2.0, 2.0, 1.0])
    tokens, _ = sample(logits.expand(B, V), temperature=1.0, top_k=2, seeds=_seeds(B)[0], offsets=_seeds(B)[1])
    assert tokens.max() <= 3 and set(tokens.tolist()) == {0, 1, 2, 3}


def test_seeding(path):
    """Same (seed, offset) -> same token, whatever the batch around it; a new offset or seed -> fresh noise."""
    B, V = 64, 257
    logits = torch.randn(B, V) * 0.5
    seeds, offsets = _seeds(B)
    a, la = sample(logits, temperature=1.0, seeds=seeds, offsets=offsets)
    b, lb = sample(logits, temperature=1.0, seeds=seeds, offsets=offsets)
    assert torch.equal(a, b) and torch.equal(la, lb)
    perm = torch.randperm(B)[:40]
    c, _ = sample(logits[perm], temperature=1.0, seeds=seeds[perm], offsets=offsets[perm])
    assert torch.equal(c, a[perm])
    d, _ = sample(logits, temperature=1.0, seeds=seeds, offsets=offsets + 1)
    e, _ = sample(logits, temperature=1.0, seeds=seeds + 1, offsets=offsets)
    assert (d == a).float().mean() < 0.3 and (e == a).float().mean() < 0.3


def test_greedy_is_argmax(path):
    B, V = 33, 517
    logits = torch.randn(B, V, dtype=torch.float16)
    tokens, logprobs = sample(logits, temperature=0.0, seeds=0, offsets=0, top_k=7, top_p=0.5)
    assert torch.equal(tokens, logits.float().argmax(1))
    ref = torch.log_softmax(logits.double(), 1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), ref, rtol=0, atol=1e-5)


def test_logprobs_match_linear_logprobs(path):
    """From hidden + LM head: the returned logprobs equal linear_logprobs of the chosen tokens (before truncation)."""
    B, H, V, T = 40, 32, 1500, 0.7
    hidden = torch.randn(B, H)
    weight = torch.randn(V, H) * 0.3
    seeds, offsets = _seeds(B)
    tokens, logprobs = sample(hidden=hidden, weight=weight, temperature=T, top_k=50, top_p=0.9, seeds=seeds,
                              offsets=offsets)  # fmt: skip
    torch.testing.assert_close(logprobs, linear_logprobs(hidden, weight, tokens, temperature=T), rtol=0, atol=2e-5)


def test_native_and_triton_draw_the_same_tokens(monkeypatch):
    """Both paths compute the same Philox bits and thresholds: identical tokens on the same inputs."""
    B, V = 160, 333
    logits = torch.randn(B, V) * 2
    temp = torch.where(torch.rand(B) < 0.1, 0.0, torch.rand(B) + 0.2)
    top_k = torch.randint(-1, 40, (B,))
    top_p = torch.where(torch.rand(B) < 0.3, 1.0, torch.rand(B) * 0.9 + 0.05)
    min_p = torch.where(torch.rand(B) < 0.5, 0.0, torch.rand(B) * 0.3)
    seeds, offsets = _seeds(B)
    out = {}
    for mode in ("native", "triton"):
        monkeypatch.setenv("ARENO_KERNELS", mode)
        out[mode] = sample(logits, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
                           offsets=offsets)  # fmt: skip
    assert torch.equal(out["native"][0], out["triton"][0])
    torch.testing.assert_close(out["native"][1], out["triton"][1], rtol=0, atol=1e-5)


def test_filters_no_row_uses_draw_what_no_filters_draw(monkeypatch):
    """top_k 0 or V, top_p 1 and min_p 0 in every row draw the tokens of no filters at all (what the engine passes
    when no row uses one: ``unused_filters``), on both paths."""
    B, V = 48, 333
    logits = torch.randn(B, V) * 2
    temp = torch.where(torch.rand(B) < 0.2, 0.0, torch.rand(B) + 0.2)
    seeds, offsets = _seeds(B)
    off = dict(top_k=torch.where(torch.rand(B) < 0.5, 0, V), top_p=torch.ones(B), min_p=torch.zeros(B))
    out = {}
    for mode in ("native", "triton"):
        monkeypatch.setenv("ARENO_KERNELS", mode)
        out[mode] = sample(logits, temperature=temp, seeds=seeds, offsets=offsets, **off)
    monkeypatch.setenv("ARENO_KERNELS", "native")
    plain = sample(logits, temperature=temp, seeds=seeds, offsets=offsets)
    assert torch.equal(out["native"][0], plain[0]) and torch.equal(out["native"][0], out["triton"][0])
    torch.testing.assert_close(out["native"][1], plain[1], rtol=0, atol=0)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="logits"):
        sample(temperature=1.0, seeds=0, offsets=0)
    with pytest.raises(ValueError, match="seeds"):
        sample(torch.randn(4, 10), temperature=1.0, seeds=torch.zeros(3, dtype=torch.int64), offsets=0)


# ---- GPU: bf16 at the real vocabulary, CUDA graphs -----------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_real_vocab(monkeypatch):
    B, V = 256, 151936
    logits = (torch.randn(B, V, device="cuda") * 3).to(torch.bfloat16)
    temp = torch.rand(B, device="cuda") + 0.5
    top_k = torch.where(torch.rand(B, device="cuda") < 0.5, 50, 0)
    top_p = torch.where(torch.rand(B, device="cuda") < 0.5, 0.9, 1.0)
    seeds, offsets = _seeds(B, "cuda")
    out = {}
    for mode in ("native", "triton"):
        monkeypatch.setenv("ARENO_KERNELS", mode)
        out[mode] = sample(logits, temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds, offsets=offsets)
    tokens, logprobs = out["triton"]
    assert (tokens == out["native"][0]).float().mean() > 0.97  # same bits; GPU log/FMA rounding may flip a few
    z = logits.float() * (1.0 / temp)[:, None]
    ref = torch.log_softmax(z.double(), 1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), ref, rtol=0, atol=1e-3)
    kth = z.topk(50, dim=1).values[:, -1]
    chosen = z.gather(1, tokens[:, None])[:, 0]
    assert (chosen[top_k == 50] >= kth[top_k == 50]).all()


@pytest.mark.gpu
def test_gpu_distribution(triton_kernels):
    V, B, T = 50, 200_000, 0.8
    logits = torch.randn(V, device="cuda") * 1.5
    seeds, offsets = _seeds(B, "cuda")
    tokens, _ = sample(logits.expand(B, V), temperature=T, top_k=20, seeds=seeds, offsets=offsets)
    keep = _kept_set(logits.cpu() / T, 20, 1.0)
    probs = torch.where(keep, torch.softmax(logits.cpu().double() / T, 0), 0.0)
    _assert_distribution(tokens.cpu(), probs / probs.sum())


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(triton_kernels):
    B, H, V = 64, 1024, 151936
    hidden = torch.randn(B, H, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.05
    temp = torch.full((B,), 0.8, device="cuda")
    top_k = torch.full((B,), 40, device="cuda", dtype=torch.int64)
    top_p = torch.full((B,), 0.95, device="cuda")
    seeds, offsets = _seeds(B, "cuda")

    def step():
        return sample(hidden=hidden, weight=weight, temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds,
                      offsets=offsets)  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_tokens, g_logprobs = step()
    for _ in range(3):
        offsets += 1
        hidden.normal_()
        graph.replay()
        tokens, logprobs = step()
        same = g_tokens == tokens  # same kernels on the same inputs (cuBLAS may pick another algorithm eagerly)
        assert same.float().mean() > 0.95 and (g_logprobs - logprobs)[same].abs().max().item() < 1e-3
    ref = linear_logprobs(hidden, weight, tokens, temperature=0.8)
    assert (ref - logprobs).abs().max().item() < 2e-3
