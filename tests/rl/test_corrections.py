"""--off-policy-correction (issue 42, point 3): each correction's weights, loss values and gradients in float64 against
hand-written per-token references on constructed cases (ratios inside and outside the bounds and the cap), the
mismatch metrics, and the corrections inside a real training step (inline update == separate pass)."""

import math

import pytest
import torch

from areno.rl.corrections import (
    Correction,
    cispo_terms,
    drop_stale,
    icepop,
    masked_is,
    mismatch_metrics,
    mismatch_sums,
    sequence_tis,
    token_tis,
    version_lag,
)
from areno.rl.losses import policy_loss, policy_token_loss
from areno.training.batch import Row

# two sequences (3 + 4 tokens), the last token of each not counted; log pi - log mu spans ratios 0.3 .. 3.3
TRAINER = [-1.0, -0.5, -2.0, -0.2, -1.5, -0.7, -3.0]
BEHAVIOUR = [-1.2, -0.5, -1.0, -1.4, -1.3, -0.6, -1.0]
MASK = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
SEQ = [0, 0, 0, 1, 1, 1, 1]
ADV = [1.0, 1.0, 1.0, -0.5, -0.5, -0.5, -0.5]
LOW, HIGH, CAP = 0.5, 2.0, 1.5


def t(xs):
    return torch.tensor(xs, dtype=torch.float64)


def ratios():
    return [math.exp(a - b) for a, b in zip(TRAINER, BEHAVIOUR)]


def seq_lists():
    """Per sequence: (sum of counted log-ratios, counted tokens)."""
    out = {}
    for a, b, m, s in zip(TRAINER, BEHAVIOUR, MASK, SEQ):
        total, n = out.get(s, (0.0, 0))
        out[s] = (total + (a - b) * m, n + m)
    return out


def log_ratio():
    return t(TRAINER) - t(BEHAVIOUR)


def test_token_tis_by_hand():
    want = [min(r, CAP) * m for r, m in zip(ratios(), MASK)]
    assert token_tis(log_ratio(), t(MASK), CAP).tolist() == pytest.approx(want, rel=1e-12)


def test_sequence_tis_is_the_truncated_product_of_the_counted_token_ratios():
    per_seq = seq_lists()
    want = [min(math.exp(per_seq[s][0]), CAP) * m for s, m in zip(SEQ, MASK)]
    got = sequence_tis(log_ratio(), t(MASK), torch.tensor(SEQ), 2, CAP)
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    assert 0 < want[0] < CAP and want[3] == CAP  # one sequence under the cap, one truncated
    long = torch.full((4000,), 0.5, dtype=torch.float64)  # a product far past float64: still the cap, no inf
    assert sequence_tis(long, torch.ones(4000, dtype=torch.float64), torch.zeros(4000, dtype=torch.long), 1,
                        CAP).unique().tolist() == [CAP]


def test_masked_is_drops_tokens_and_whole_sequences_outside_the_bounds():
    per_seq = seq_lists()
    want = []
    for r, m, s in zip(ratios(), MASK, SEQ):
        seq_ratio = math.exp(per_seq[s][0] / per_seq[s][1])
        want.append(float(LOW <= r <= HIGH and LOW <= seq_ratio <= HIGH) * m)
    got = masked_is(log_ratio(), t(MASK), torch.tensor(SEQ), 2, LOW, HIGH)
    assert got.tolist() == want
    assert 0 < sum(want) < sum(MASK)  # something is kept and something dropped
    # a tighter upper bound drops the first sequence whole (its geometric mean is 1.105)
    tight = masked_is(log_ratio(), t(MASK), torch.tensor(SEQ), 2, 0.99, 1.1)
    assert tight[:3].tolist() == [0.0, 0.0, 0.0]


def test_icepop_keeps_the_ratio_inside_the_bounds_and_zero_outside():
    want = [(r if LOW <= r <= HIGH else 0.0) * m for r, m in zip(ratios(), MASK)]
    assert icepop(log_ratio(), t(MASK), LOW, HIGH).tolist() == pytest.approx(want, rel=1e-12)
    assert any(w == 0 for w, m in zip(want, MASK) if m) and any(w > 0 for w in want)


@pytest.mark.parametrize("kind", ["tis", "seq-tis", "mask", "icepop"])
def test_weighted_policy_loss_values_and_gradients_by_hand(kind):
    """The correction's weight multiplies each token's clipped-surrogate term: loss and d loss / d logp against
    per-token formulas (token-mean over the counted tokens)."""
    corr = Correction(kind, cap=CAP, low=LOW, high=HIGH)
    weights = corr.weights(log_ratio(), t(MASK), torch.tensor(SEQ), 2)
    # the update's log-probs moved a little from the trainer's view of the rollout
    logp_now = [a + d for a, d in zip(TRAINER, [0.3, -0.1, 0.0, 0.5, -0.4, 0.05, 0.0])]
    logp = t(logp_now).requires_grad_(True)
    n = sum(MASK)
    loss, _ = policy_loss(logp, t(BEHAVIOUR), t(ADV), t(MASK), torch.tensor(SEQ), num_rows=2, norm=n,
                          clip_low=0.2, clip_high=0.28, tis_weight=weights)
    loss.backward()
    want_loss, want_grad = 0.0, []
    for lp, old, a, m, w in zip(logp_now, BEHAVIOUR, ADV, MASK, weights.tolist()):
        r = math.exp(lp - old)
        unclipped, clipped = -a * r, -a * min(max(r, 0.8), 1.28)
        want_loss += w * max(unclipped, clipped) * m / n
        # the gradient flows through r only where the unclipped term is the larger one
        want_grad.append(w * -a * r * m / n if unclipped >= clipped else 0.0)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert logp.grad.tolist() == pytest.approx(want_grad, rel=1e-12, abs=1e-15)


def test_cispo_value_and_gradient_by_hand():
    """CISPO: -sg(clip(r, 1 - low, 1 + high)) A log pi: every token has a gradient, its weight clipped."""
    logp_now = [a + d for a, d in zip(BEHAVIOUR, [0.3, -0.1, 0.0, 0.5, -0.4, 0.05, 0.0])]
    logp = t(logp_now).requires_grad_(True)
    n = sum(MASK)
    loss, stats = policy_loss(logp, t(BEHAVIOUR), t(ADV), t(MASK), torch.tensor(SEQ), num_rows=2, norm=n,
                              clip_low=0.2, clip_high=0.28, cispo=True, dual_clip=3.0)
    loss.backward()
    want_loss, want_grad, clipped = 0.0, [], 0
    for lp, old, a, m in zip(logp_now, BEHAVIOUR, ADV, MASK):
        r = math.exp(lp - old)
        w = min(max(r, 0.8), 1.28)
        clipped += (w != r) * m
        want_loss += -w * a * lp * m / n
        want_grad.append(-w * a * m / n)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert logp.grad.tolist() == pytest.approx(want_grad, rel=1e-12)
    assert all(g != 0 for g, m in zip(want_grad, MASK) if m)  # clipped tokens still learn (unlike PPO's clip)
    assert stats["clip_frac_sum"].item() == clipped > 0
    pg, ratio, frac = cispo_terms(t(logp_now), t(BEHAVIOUR), t(ADV), 0.2, 0.28)
    assert ratio.tolist() == pytest.approx([math.exp(a - b) for a, b in zip(logp_now, BEHAVIOUR)], rel=1e-12)


@pytest.mark.parametrize("kind", ["tis", "icepop", "cispo"])
def test_head_token_function_matches_the_loss_with_inline_weights(kind):
    """The fused head's token function (policy_token_loss) with the correction's weights taken from its own
    log-probs gives the loss and gradient of policy_loss with those weights."""
    corr = Correction(kind, cap=CAP, low=LOW, high=HIGH)
    kw = dict(num_rows=2, norm=sum(MASK), clip_low=0.2, clip_high=0.28, cispo=kind == "cispo")
    x = t(TRAINER).requires_grad_(True)
    weights = corr.weights(log_ratio(), t(MASK))
    ref, _ = policy_loss(x, t(BEHAVIOUR), t(ADV), t(MASK), torch.tensor(SEQ), tis_weight=weights, **kw)
    ref.backward()
    f = policy_token_loss(t(BEHAVIOUR), t(ADV), t(MASK), torch.tensor(SEQ),
                          inline_weights=corr.weights if corr.weighs else None, **kw)
    y = t(TRAINER).requires_grad_(True)
    total = f(y[:4], 0, 4).sum() + f(y[4:], 4, 7).sum()
    total.backward()
    assert total.item() == pytest.approx(ref.item(), rel=1e-12)
    assert y.grad.tolist() == pytest.approx(x.grad.tolist(), rel=1e-12)


def test_mismatch_metrics_by_hand():
    weights = icepop(log_ratio(), t(MASK), LOW, HIGH)
    sums = mismatch_sums(log_ratio(), t(MASK), weights)
    top = sums.pop("is_ratio_max")
    m = mismatch_metrics(sums, float(top))
    counted = [(r, w) for r, w, k in zip(ratios(), weights.tolist(), MASK) if k]
    assert m["is_ratio_mean"] == pytest.approx(sum(r for r, _ in counted) / 5, rel=1e-12)
    assert m["is_ratio_max"] == pytest.approx(max(r for r, _ in counted), rel=1e-12)
    assert m["masked_frac"] == sum(w == 0 for _, w in counted) / 5
    # k3 estimate of KL(mu || pi) from mu's samples: r - 1 - log r >= 0, zero only on policy
    assert m["mismatch_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r, _ in counted) / 5, rel=1e-12)
    on_policy = mismatch_metrics({k: v for k, v in mismatch_sums(t([0.0] * 3), t([1.0] * 3), None).items()
                                  if k != "is_ratio_max"}, 1.0)
    assert on_policy == {"is_ratio_mean": 1.0, "is_ratio_max": 1.0, "masked_frac": 0.0, "mismatch_kl": 0.0}


def test_policy_version_lag():
    def row(meta=None, versions=None):
        return Row([1], [2, 3], meta=meta or {}, versions=versions)

    assert version_lag([row(), row()], 5, None) == {"policy_version_lag_mean": 0.0,
                                                   "policy_version_lag_max": 0.0}  # colocated
    assert version_lag([row(), row()], 5, 4) == {"policy_version_lag_mean": 1.0, "policy_version_lag_max": 1.0}
    rows = [row({"policy_version": 2}), row({"policy_version": 5}), row()]
    assert version_lag(rows, 5, 4) == {"policy_version_lag_mean": 4 / 3, "policy_version_lag_max": 3.0}
    # partial rollout: a row's oldest token counts, over its meta and the batch's version
    rows = [row({"policy_version": 4}, versions=[1, 3]), row(versions=[4, 5]), row()]
    assert version_lag(rows, 5, 4) == {"policy_version_lag_mean": 2.0, "policy_version_lag_max": 4.0}
    kept, dropped = drop_stale(rows, 5, 4, 3)
    assert kept == rows[1:] and dropped == 1  # lag 4 > K = 3
    assert drop_stale(rows, 5, 4, 4) == (rows, 0) and drop_stale([row()], 5, None, 0) == ([row()], 0)


# ---- inside a real training step (tiny checkpoint, CPU) ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from tests.helpers.families import tiny_rl_files

    root = tmp_path_factory.mktemp("corrections")
    return (*tiny_rl_files(root), root)


def one_step(tiny_run, monkeypatch, inline, **kw):
    """One step of a tiny run (``inline``: the update's own forward gives the trainer's view of the rollout tokens;
    else the separate no-grad pass): its metrics and the weights after it."""
    from areno.config import TrainConfig
    from areno.rl.algorithms import grpo
    from areno.rl.loop import TrainLoop

    ckpt, data, reward, root = tiny_run
    cfg = TrainConfig(ckpt=str(ckpt), dataset_path=str(data), reward_fn_path=str(reward), batch_size=4, n_samples=2,
                      mini_bs=2, max_new_tokens=6, dtype="float32", lr=1e-3, tensorboard=False, seed=0,
                      metrics_dir=str(root / "m"), gradient_accumulation_steps=4, max_steps=1, temperature=0.7, **kw)
    loop = TrainLoop(cfg)
    loop.setup()
    monkeypatch.setattr(grpo, "makes_one_update", lambda ctx, rows: inline)
    m = loop.step(next(iter(loop.data)))
    loop.close()
    return m, [p.detach().clone() for p in loop.model.parameters()]


METRICS = ("is_ratio_mean", "is_ratio_max", "masked_frac", "mismatch_kl", "policy_version_lag_mean",
           "policy_version_lag_max")


@pytest.mark.parametrize("algo,kind", [("grpo", "mask"), ("grpo", "cispo"), ("gspo", "seq-tis")])
def test_each_correction_inline_equals_the_separate_pass(tiny_run, monkeypatch, algo, kind):
    """The inline proximal update and the separate log-prob pass give the same weights and metrics; the metrics
    are there every step (colocated: no lag; fp32 native kernels: the trainer agrees with the rollout)."""
    kw = dict(algo=algo, off_policy_correction=kind)
    if kind in ("mask", "icepop"):  # bounds tight enough to drop some tokens of the fp32 rollout/trainer mismatch
        kw.update(is_mask_low=0.999999, is_mask_high=1.000001)
    m1, w1 = one_step(tiny_run, monkeypatch, True, **kw)
    m0, w0 = one_step(tiny_run, monkeypatch, False, **kw)
    assert m1["num_updates"] == m0["num_updates"] == 1
    for k in ("loss", "logprob_diff", "is_ratio_mean", "is_ratio_max", "mismatch_kl"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6), k
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(w1, w0))
    for m in (m0, m1):
        assert set(METRICS) <= set(m)
        assert m["policy_version_lag_mean"] == m["policy_version_lag_max"] == 0.0
        assert m["is_ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["mismatch_kl"] < 1e-8
        assert 0.0 <= m["masked_frac"] <= 1.0
    if kind not in ("mask", "icepop"):
        assert m0["masked_frac"] == m1["masked_frac"] == 0.0


def _main_tis(self, log_ratio, mask, seq_index=None, num_rows=1):
    """main's --tis-cap weights, as it wrote them: python's math.exp per token in the separate pass (float64 here),
    ``torch.exp(delta).clamp(max=cap) * (mask > 0)`` inline."""
    if self.cap <= 0:
        return None
    if log_ratio.dtype == torch.float64:
        return torch.tensor([min(math.exp(x), self.cap) for x in log_ratio.tolist()], dtype=torch.float64)
    return torch.exp(log_ratio.detach()).clamp(max=self.cap) * (mask > 0)


@pytest.mark.parametrize("inline", [True, False])
def test_the_default_run_is_main_s_token_tis_bit_for_bit(tiny_run, monkeypatch, inline):
    """The default (--off-policy-correction tis, --tis-cap 2) trains exactly as main's token-level TIS did."""
    m_new, w_new = one_step(tiny_run, monkeypatch, inline)
    monkeypatch.setattr(Correction, "weights", _main_tis)
    m_old, w_old = one_step(tiny_run, monkeypatch, inline)
    assert all(torch.equal(a, b) for a, b in zip(w_new, w_old))
    assert m_new["loss"] == m_old["loss"]


def test_a_config_refuses_a_token_level_correction_for_gspo():
    from areno.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="--off-policy-correction icepop is not built for --algo gspo"):
        TrainConfig(ckpt="m", dataset_path="d.jsonl", algo="gspo", off_policy_correction="icepop")
    with pytest.raises(ConfigError, match="--is-mask-high must be > --is-mask-low"):
        TrainConfig(ckpt="m", dataset_path="d.jsonl", algo="grpo", off_policy_correction="mask", is_mask_low=2.0)
    cfg = TrainConfig(ckpt="m", dataset_path="d.jsonl", algo="gspo", off_policy_correction="seq-tis")
    assert Correction.of(cfg) == Correction("seq-tis", cap=2.0, low=0.5, high=2.0)


def test_split_async_run_reports_the_policy_version_lag(tiny_run, tmp_path):
    """Split mode with --max-staleness 1 (gloo on a CPU): the lag metrics follow the rows' policy version, and a
    correction (icepop) trains on the stale rows."""
    from tests.helpers.split_runs import areno, metrics

    out = tmp_path / "async"
    areno(tiny_run[:3], out, "--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "1",
          "--off-policy-correction", "icepop", steps=3)
    ms = metrics(out)
    assert [m["policy_version_lag_max"] for m in ms] == [m["staleness_max"] for m in ms] == [0, 1, 1]
    assert [m["policy_version_lag_mean"] for m in ms] == [0, 1, 1]
    assert all(m["is_ratio_max"] >= m["is_ratio_mean"] > 0 and m["mismatch_kl"] >= 0 for m in ms)
    assert all(0.0 <= m["masked_frac"] <= 1.0 and m["loss"] is not None for m in ms)
