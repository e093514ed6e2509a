"""draw_from_probs (a speculative draft's Gumbel-max draw from its probabilities): the kernel (interpreted on the
CPU, compiled on the GPU) picks the native oracle's token on fresh random rows of odd shapes, with zero
probabilities, one-hot (greedy) rows and ties; the draws follow q (chi-square); bad shapes are refused."""

import pytest
import torch

from areno.kernels.draft_draw import draw_from_probs, draw_native


def _rows(B, V, g, device="cpu"):
    q = torch.rand(B, V, generator=g) ** 4  # skewed, as a model's distribution is
    q[:, torch.randperm(V, generator=g)[: V // 3]] = 0.0  # a top-k / top-p cut
    q[0] = 0.0
    q[0, V // 2] = 1.0  # a greedy row: one-hot
    if B > 2:
        q[2, :] = 1.0 / V  # every column tied on probability: the noise alone decides
    q = (q / q.sum(1, keepdim=True)).to(device)
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=g).to(device)
    offsets = torch.randint(0, 2**42, (B,), generator=g).to(device)
    return q, seeds, offsets


@pytest.mark.parametrize("B,V", [(1, 7), (3, 130), (5, 1001), (9, 333)])
def test_the_kernel_draws_the_oracles_token(triton_kernels, B, V):
    g = torch.Generator().manual_seed(B * 1000 + V)
    q, seeds, offsets = _rows(B, V, g)
    got = draw_from_probs(q, seeds, offsets)
    want = draw_native(q, seeds, offsets)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert got[0].item() == V // 2 and all(q[i, t] > 0 for i, t in enumerate(got.tolist()))


def test_draws_follow_the_distribution(triton_kernels):
    """2,000 draws of one row (offsets 0..1999) against q: chi-square with 5 categories under its 0.999 quantile."""
    q = torch.tensor([[0.4, 0.0, 0.25, 0.2, 0.1, 0.05]]).repeat(2000, 1)
    got = draw_from_probs(q, torch.full((2000,), 12345, dtype=torch.int64), torch.arange(2000, dtype=torch.int64))
    counts = torch.bincount(got, minlength=6).double()
    assert counts[1] == 0
    expected = q[0].double() * 2000
    chi2 = sum((counts[i] - expected[i]) ** 2 / expected[i] for i in (0, 2, 3, 4, 5))
    assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


def test_a_row_of_zeros_draws_token_zero_as_argmax_does(triton_kernels):
    q = torch.zeros(2, 300)
    q[1, 299] = 1.0
    seeds, offsets = torch.tensor([3, 4]), torch.tensor([0, 1])
    assert draw_from_probs(q, seeds, offsets).tolist() == draw_native(q, seeds, offsets).tolist() == [0, 299]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="draw_from_probs"):
        draw_from_probs(torch.ones(2, 4), torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_draws_the_oracles_token_on_the_gpu():
    """The compiled kernel (libdevice's float64 logs) against the native ops on the same GPU, at a vocabulary's size
    and 1-256 rows: the same tokens (the exact rejection sampling's draft draws)."""
    g = torch.Generator().manual_seed(0)
    for B, V in [(1, 151936), (7, 151936), (64, 151936), (256, 248320), (3, 1001)]:
        q, seeds, offsets = _rows(B, V, g, "cuda")
        assert draw_from_probs(q, seeds, offsets).tolist() == draw_native(q, seeds, offsets).tolist()
