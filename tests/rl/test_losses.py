"""Every loss against a hand-written reference on fixed tensors: values and gradients."""

import math

import pytest
import torch

from areno.rl.advantages import gae, group_advantages
from areno.rl.losses import dpo_loss, gspo_loss, kl_penalty, policy_loss, sft_loss, value_loss

LOGP = [-1.0, -0.5, -2.0, -0.1, -0.7]
OLD = [-1.1, -0.5, -1.5, -0.3, -0.7]
ADV = [1.0, 1.0, -2.0, -2.0, 0.5]
MASK = [1.0, 1.0, 1.0, 1.0, 0.0]
SEQ = [0, 0, 1, 1, 1]


def t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def test_sft_normalises_by_the_group_token_count():
    logp = t(LOGP, True)
    loss, _ = sft_loss(logp, t(MASK), num_tokens=8)
    assert loss.item() == pytest.approx(-(-1.0 - 0.5 - 2.0 - 0.1) / 8)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1 / 8] * 4 + [0.0])


def test_grpo_clipped_surrogate_by_hand():
    logp = t(LOGP, True)
    loss, stats = policy_loss(logp, t(OLD), t(ADV), t(MASK), torch.tensor(SEQ), num_rows=2, norm=4,
                              clip_low=0.2, clip_high=0.28)
    expect, grads, clipped = 0.0, [], 0
    for lp, old, a, m in zip(LOGP, OLD, ADV, MASK):
        r = math.exp(lp - old)
        c = min(max(r, 0.8), 1.28)
        unclipped = -a * r >= -a * c
        term = max(-a * r, -a * c)
        expect += m * term / 4
        grads.append(m * (-a * r / 4 if unclipped else 0.0))
        clipped += m * (not unclipped)
    assert loss.item() == pytest.approx(expect)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx(grads)
    assert stats["clip_frac_sum"].item() == clipped == 1  # token 2: r = 0.61 < 0.8 with A < 0


def test_on_policy_ratio_is_one_and_kl_zero():
    logp = t(LOGP, True)
    loss, stats = policy_loss(logp, t(LOGP), t(ADV), t(MASK), torch.tensor(SEQ), num_rows=2, norm=4,
                              ref_logp=t(LOGP), kl_coef=0.1)
    assert stats["ratio_sum"].item() == pytest.approx(4.0) and stats["kl_sum"].item() == 0.0
    assert stats["clip_frac_sum"].item() == 0.0


def test_dual_clip_and_tis_weight():
    logp, old = t([0.0], True), t([-3.0])  # ratio e^3, negative advantage: bounded by -c A
    loss, _ = policy_loss(logp, old, t([-1.0]), t([1.0]), torch.tensor([0]), num_rows=1, norm=1, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    loss, _ = policy_loss(t([0.0], True), t([0.0]), t([1.0]), t([1.0]), torch.tensor([0]), num_rows=1, norm=1,
                          tis_weight=t([0.5]))
    assert loss.item() == pytest.approx(-0.5)


def test_kl_estimators():
    lp, ref = t([-1.0]), t([-1.5])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def test_gspo_sequence_ratio_by_hand():
    logp = t(LOGP, True)
    seq_adv = t([1.0, 1.0])
    loss, _ = gspo_loss(logp, t(OLD), seq_adv, t(MASK), torch.tensor(SEQ), num_rows=2, num_seqs=2)
    s0 = math.exp(((-1.0 + 1.1) + 0.0) / 2)
    s1 = math.exp(((-2.0 + 1.5) + (-0.1 + 0.3)) / 2)
    term0 = max(-1 * s0, -1 * min(max(s0, 1 - 3e-4), 1 + 4e-4))
    term1 = max(-1 * s1, -1 * min(max(s1, 1 - 3e-4), 1 + 4e-4))
    assert loss.item() == pytest.approx((term0 + term1) / 2)
    loss.backward()
    # seq 0 is clipped (s0 > 1 + eps with A > 0): no gradient; seq 1 (s1 < 1 - eps, A > 0) is not:
    # d/dlogp_t of -s A / 2 seqs = -s / (2 tokens) / 2; the masked token gets nothing
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -s1 / 4, -s1 / 4, 0.0])


def test_dpo_sigmoid_and_label_smoothing():
    c, r = t([-3.0], True), t([-4.0], True)
    loss, stats = dpo_loss(c, r, t([-3.5]), t([-3.8]), beta=0.1, num_pairs=1)
    z = 0.1 * ((-3.0 + 3.5) - (-4.0 + 3.8))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-z)))
    loss.backward()
    sig = 1 / (1 + math.exp(z))
    assert c.grad.item() == pytest.approx(-0.1 * sig) and r.grad.item() == pytest.approx(0.1 * sig)
    loss, _ = dpo_loss(t([-3.0]), t([-4.0]), t([-3.5]), t([-3.8]), beta=0.1, label_smoothing=0.2, num_pairs=1)
    assert loss.item() == pytest.approx(0.8 * math.log1p(math.exp(-z)) + 0.2 * math.log1p(math.exp(z)))


def test_value_loss_clip():
    v, old, ret = t([1.0, 0.0], True), t([0.5, 0.0]), t([0.0, 1.0])
    loss, _ = value_loss(v, old, ret, t([1.0, 1.0]), clip=0.2, norm=2)
    # token 0: max((1-0)^2, (0.7-0)^2) = 1; token 1: max(1, 1) = 1
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)


def test_group_advantages_and_zero_variance():
    adv, zero = group_advantages(t([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0]), 4)
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std().item()
    assert adv[:4].tolist() == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 2)
    assert adv[4:].tolist() == [0.0] * 4 and zero.tolist() == [False, True]
    adv, _ = group_advantages(t([1.0, 0.0]), 2, std_normalize=False)
    assert adv.tolist() == [0.5, -0.5]


def test_gae_by_hand():
    r = t([[0.0, 0.0, 1.0, 0.0]])
    v = t([[0.5, 0.6, 0.7, 9.0]])
    m = t([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2, 0.0])
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7, 0.0])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_token_loss_sums_to_policy_loss(agg):
    """The token function (for linear_logprobs_loss) over any split of the tokens: its terms sum to policy_loss's
    loss and their gradients by each log-prob are policy_loss's, with KL, dual clip and truncated weights."""
    from areno.rl.losses import policy_token_loss

    kw = dict(num_rows=2, norm=3.0, loss_agg=agg, dual_clip=2.5, kl_coef=0.1, ref_logp=t(OLD), clip_low=0.2,
              clip_high=0.28)
    tis = t([0.9, 1.0, 1.1, 0.5, 1.0])
    logp = t(LOGP, True)
    ref, _ = policy_loss(logp, t(OLD), t(ADV), t(MASK), torch.tensor(SEQ), tis_weight=tis, **kw)
    ref.backward()
    f = policy_token_loss(t(OLD), t(ADV), t(MASK), torch.tensor(SEQ), tis_weight=tis, **kw)
    x = t(LOGP, True)
    total = f(x[:2], 0, 2).sum() + f(x[2:], 2, 5).sum()  # two chunks
    total.backward()
    assert total.item() == pytest.approx(ref.item())
    assert x.grad.tolist() == pytest.approx(logp.grad.tolist())
    # tis_cap: the weights come from the log-probs themselves (detached), as inline_proximal takes them
    capped = [min(math.exp(a - b), 1.2) * m for a, b, m in zip(LOGP, OLD, MASK)]
    ref2, _ = policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), torch.tensor(SEQ), tis_weight=t(capped), **kw)
    from areno.rl.corrections import token_tis

    g = policy_token_loss(t(OLD), t(ADV), t(MASK), torch.tensor(SEQ),
                          inline_weights=lambda lr, m: token_tis(lr, m, 1.2), **kw)
    assert g(t(LOGP), 0, 5).sum().item() == pytest.approx(ref2.item())
