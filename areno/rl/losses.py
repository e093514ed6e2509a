"""Losses of the five algorithms over one packed microbatch.

Every function takes per-token tensors of the microbatch, flattened over its packed rows (``[T]``), a 0/1
``mask`` of the tokens that count (response tokens), ``seq_index [T]`` (row of each token, for sequence-level
terms), and the normaliser of the whole optimizer step (``num_tokens`` or ``num_seqs`` summed over every
microbatch and data-parallel rank of the accumulation group). Each returns ``(loss, stats)``: ``loss`` is this
microbatch's share, so summing the backward passes of all microbatches gives the gradient of the global mean, not
a mean of microbatch means. ``stats`` holds detached sums (divide by the same normaliser to report them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areno.rl.corrections import cispo_terms


def _seq_sum(x: torch.Tensor, seq_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    return torch.zeros(num_rows, dtype=x.dtype, device=x.device).index_add_(0, seq_index, x)


def aggregate_weights(mask: torch.Tensor, seq_index: torch.Tensor, num_rows: int, mode: str,
                      norm: float) -> torch.Tensor:
    """Per-token weights with ``aggregate(x) == (x * weights).sum()`` (up to summation order)."""
    if mode in ("token-mean", "seq-mean-token-sum"):
        return mask / norm
    if mode == "seq-mean-token-mean":
        counts = _seq_sum(mask.to(torch.float32), seq_index, num_rows).clamp(min=1)
        return mask / (counts[seq_index] * norm)
    raise ValueError(f"unknown --loss-agg {mode!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, num_rows: int, mode: str,
              norm: float) -> torch.Tensor:
    """Sum this microbatch's contribution to the global aggregate.

    token-mean: sum over tokens / global token count. seq-mean-token-sum: per-row sums, / global row count.
    seq-mean-token-mean: per-row means, / global row count.
    """
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / norm
    sums = _seq_sum(masked, seq_index, num_rows)
    if mode == "seq-mean-token-sum":
        return sums.sum() / norm
    if mode == "seq-mean-token-mean":
        counts = _seq_sum(mask.to(sums.dtype), seq_index, num_rows).clamp(min=1)
        return (sums / counts).sum() / norm
    raise ValueError(f"unknown --loss-agg {mode!r}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown --kl-estimator {estimator!r}")


def sft_loss(logp, mask, *, num_tokens):
    """Mean NLL over the response tokens of the accumulation group."""
    nll = -(logp * mask).sum()
    return nll / num_tokens, {"nll_sum": nll.detach(), "tokens": mask.sum().detach()}


def dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, beta=0.1, label_smoothing=0.0,
             num_pairs):
    """Sigmoid DPO over per-pair summed response log-probs (``[P]`` each); conservative DPO with label smoothing."""
    margin = (chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp)
    logits = beta * margin
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    stats = {
        "reward_margin_sum": (beta * margin).detach().sum(),
        "accuracy_sum": (margin > 0).float().sum().detach(),
        "pairs": torch.tensor(float(margin.numel())),
    }
    return losses.sum() / num_pairs, stats


def policy_loss(logp, old_logp, advantages, mask, seq_index, *, num_rows, norm, clip_low=0.2, clip_high=0.28,
                dual_clip=None, loss_agg="token-mean", tis_weight=None, ref_logp=None, kl_coef=0.0,
                kl_estimator="k3", entropy=None, entropy_coef=0.0, cispo=False):
    """GRPO/PPO token-level clipped surrogate.

    ratio = exp(logp - old_logp) with ``old_logp`` the rollout log-probs; -min(r A, clip(r, 1-low, 1+high) A);
    with ``dual_clip`` c, negative-advantage tokens are also bounded by -c A. ``tis_weight`` (detached, already
    truncated at the cap) multiplies each token's policy term: truncated importance sampling against the
    rollout/trainer mismatch (or the weight of another --off-policy-correction). ``cispo``: CISPO's term instead of
    the clipped surrogate (areno.rl.corrections.cispo_terms; the clip bounds clip its IS weight). Optional KL to a
    reference and entropy bonus.
    """
    pg, ratio, clip_frac, per_token, kl = _policy_terms(logp, old_logp, advantages, clip_low, clip_high, dual_clip,
                                                        tis_weight, ref_logp, kl_coef, kl_estimator, cispo)
    stats = {}
    if kl is not None:
        stats["kl_sum"] = (kl * mask).sum().detach()
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    if entropy is not None:
        stats["entropy_sum"] = (entropy * mask).sum().detach()
    loss = aggregate(per_token, mask, seq_index, num_rows, loss_agg, norm)
    stats.update({
        "pg_sum": (pg * mask).sum().detach(),
        "clip_frac_sum": (clip_frac * mask).sum().detach(),
        "ratio_sum": (ratio * mask).sum().detach(),
        "tokens": mask.sum().detach(),
    })
    return loss, stats


def _policy_terms(logp, old_logp, advantages, clip_low, clip_high, dual_clip, tis_weight, ref_logp, kl_coef,
                  kl_estimator, cispo=False):
    """policy_loss's per-token terms: (pg, ratio, clip_frac, per_token = pg [+ kl_coef kl], kl or None)."""
    if cispo:
        pg, ratio, clip_frac = cispo_terms(logp, old_logp, advantages, clip_low, clip_high)
    else:
        ratio = torch.exp(logp - old_logp)
        clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
        pg1, pg2 = -advantages * ratio, -advantages * clipped
        pg = torch.maximum(pg1, pg2)
        clip_frac = (pg2 > pg1).float()
    if dual_clip is not None and not cispo:  # CISPO's weight is bounded already (--dual-clip is refused with it)
        bound = -advantages * dual_clip
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)
    if tis_weight is not None:
        pg = pg * tis_weight
    per_token, kl = pg, None
    if ref_logp is not None and kl_coef:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        per_token = per_token + kl_coef * kl
    return pg, ratio, clip_frac, per_token, kl


def policy_token_loss(old_logp, advantages, mask, seq_index, *, num_rows, norm, clip_low=0.2, clip_high=0.28,
                      dual_clip=None, loss_agg="token-mean", tis_weight=None, inline_weights=None, ref_logp=None,
                      kl_coef=0.0, kl_estimator="k3", cispo=False):
    """policy_loss's loss (without entropy) as a token function for ``linear_logprobs_loss``: ``f(logp, start,
    end)`` gives tokens ``[start, end)`` their aggregate weight times their per-token term, so its sum over every
    token is policy_loss's loss. ``inline_weights(log_ratio, mask) -> weights``: a token-level correction's weights
    are taken from the log-probs being computed (detached), ``log_ratio = logp - old_logp``, as ``inline_proximal``
    takes them (e.g. ``min(exp(log_ratio), --tis-cap)``)."""
    weights = aggregate_weights(mask, seq_index, num_rows, loss_agg, norm)

    def f(logp, start, end):
        sl = slice(start, end)
        tis = None if tis_weight is None else tis_weight[sl]
        if inline_weights is not None:
            tis = inline_weights(logp.detach() - old_logp[sl], mask[sl])
        per_token = _policy_terms(logp, old_logp[sl], advantages[sl], clip_low, clip_high, dual_clip, tis,
                                  None if ref_logp is None else ref_logp[sl], kl_coef, kl_estimator, cispo)[3]
        return weights[sl] * per_token

    return f


def gspo_loss(logp, old_logp, seq_advantages, mask, seq_index, *, num_rows, num_seqs, clip_low=3e-4,
              clip_high=4e-4, ref_logp=None, kl_coef=0.0, kl_estimator="k3", num_tokens=None, seq_weight=None):
    """GSPO: sequence-level ratio s = exp(mean_t(logp - old_logp)) over each row's response tokens, clipped at
    [1 - low, 1 + high]; -min(s A, clip(s) A) averaged over the sequences of the global batch. ``seq_weight``
    ``[num_rows]`` (detached): a sequence-level correction's weight on each sequence's term (seq-tis)."""
    counts = _seq_sum(mask.float(), seq_index, num_rows).clamp(min=1)
    mean_log_ratio = _seq_sum((logp - old_logp) * mask, seq_index, num_rows) / counts
    s = torch.exp(mean_log_ratio)
    clipped = s.clamp(1 - clip_low, 1 + clip_high)
    pg1, pg2 = -seq_advantages * s, -seq_advantages * clipped
    valid = (_seq_sum(mask.float(), seq_index, num_rows) > 0).float()
    pg = torch.maximum(pg1, pg2) * valid
    if seq_weight is not None:
        pg = pg * seq_weight
    loss = pg.sum() / num_seqs
    stats = {
        "pg_sum": pg.detach().sum(),
        "clip_frac_sum": ((pg2 > pg1).float() * valid).sum().detach(),
        "ratio_sum": (s * valid).detach().sum(),
        "seqs": valid.sum(),
    }
    if ref_logp is not None and kl_coef:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        loss = loss + kl_coef * (kl * mask).sum() / (num_tokens or mask.sum().clamp(min=1))
        stats["kl_sum"] = (kl * mask).sum().detach()
    return loss, stats


def value_loss(values, old_values, returns, mask, *, clip=0.2, norm):
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), token mean."""
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss = 0.5 * torch.maximum((values - returns).square(), (v_clipped - returns).square())
    clip_frac = ((values - returns).square() < (v_clipped - returns).square()).float()
    return (loss * mask).sum() / norm, {
        "vf_sum": (loss * mask).sum().detach(),
        "vf_clip_frac_sum": (clip_frac * mask).sum().detach(),
    }
