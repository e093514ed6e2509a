"""Per-algorithm loss functions (LossFn) in the trainer's ``loss_fn(out, packed, norms) -> (loss, stats)`` form."""

from __future__ import annotations

import torch

from areno.rl.corrections import Correction, mismatch_sums
from areno.rl.losses import dpo_loss, gspo_loss, policy_loss, policy_token_loss, sft_loss
from areno.training.loss import LossFn


def sft_loss_fn() -> LossFn:
    """Mean NLL of the response tokens. Linear in the log-probs: its ``token_weights`` (-mask / tokens) let the
    trainer take the head's gradient in the forward (``ForwardOut.loss``, the same value)."""

    def fn(out, packed, norms):
        loss, stats = sft_loss(out.logprobs, packed.mask, num_tokens=norms.num_tokens)
        return (loss if out.loss is None else out.loss), stats

    return LossFn(fn, token_weights=lambda packed, norms: packed.mask * (-1.0 / norms.num_tokens))


def grpo_loss_fn(cfg, *, dual_clip=None) -> LossFn:
    """Token-level clipped surrogate (CISPO's term with --off-policy-correction cispo); old log-probs are the
    rollout's. Rows may carry per-token ``tis`` weights (the correction's) and ``ref`` log-probs in their extras.
    A function of each token's own log-prob: its ``token_loss(packed, norms)`` (policy_token_loss) lets the
    trainer take the head's gradient in the forward (``ForwardOut.loss``, the same value) where no entropy term is
    asked for."""

    cispo = cfg.off_policy_correction == "cispo"

    def norm_of(norms):
        return norms.num_tokens if cfg.loss_agg == "token-mean" else norms.num_seqs

    def fn(out, packed, norms):
        loss, stats = policy_loss(
            out.logprobs, packed.old_logprobs, packed.advantages, packed.mask, packed.seq_index,
            num_rows=packed.num_rows, norm=norm_of(norms), clip_low=cfg.clip_eps_low, clip_high=cfg.clip_eps_high,
            dual_clip=dual_clip, loss_agg=cfg.loss_agg, tis_weight=packed.tok.get("tis"),
            ref_logp=packed.tok.get("ref"), kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
            entropy=out.entropy, entropy_coef=cfg.entropy_coef, cispo=cispo,
        )
        return (loss if out.loss is None else out.loss), stats

    def token_loss(packed, norms, inline_weights=None):
        return policy_token_loss(
            packed.old_logprobs, packed.advantages, packed.mask, packed.seq_index, num_rows=packed.num_rows,
            norm=norm_of(norms), clip_low=cfg.clip_eps_low, clip_high=cfg.clip_eps_high, dual_clip=dual_clip,
            loss_agg=cfg.loss_agg, tis_weight=packed.tok.get("tis"), inline_weights=inline_weights,
            ref_logp=packed.tok.get("ref"), kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, cispo=cispo,
        )

    return LossFn(fn, token_loss=token_loss)


class InlineProximal:
    """A policy loss for one update per rollout batch: the update's forward, detached, gives the trainer's log-probs
    of the rollout tokens (the weights have not moved yet), from which the correction's weights (``correction``, an
    areno.rl.corrections.Correction; ``packed.tok['tis']``) and the rollout-vs-trainer difference are taken, saving a
    separate no-grad pass. Adds the stats ``logprob_diff_total``/``logprob_diff_count`` and mismatch_sums' totals
    (summed over microbatches and ranks); this rank's largest difference and ratio are kept in ``max_diff`` and
    ``max_ratio`` (device scalars, None before the first microbatch)."""

    def __init__(self, loss_fn, correction: Correction):
        self.loss_fn, self.correction, self.max_diff, self.max_ratio = loss_fn, correction, None, None

    def __call__(self, out, packed, norms):
        lp = out.logprobs.detach()
        mask = packed.mask > 0
        delta = lp - packed.old_logprobs
        weights = self.correction.weights(delta, packed.mask, packed.seq_index, packed.num_rows)
        if weights is not None:
            packed.tok["tis"] = weights
        loss, stats = self.loss_fn(out, packed, norms)
        diff = delta.abs() * mask  # device scalars only: no host sync per microbatch
        top = diff.max() if diff.numel() else diff.new_zeros(())
        self.max_diff = top if self.max_diff is None else torch.maximum(self.max_diff, top)
        sums = mismatch_sums(delta, packed.mask, weights)
        ratio = sums.pop("is_ratio_max")
        self.max_ratio = ratio if self.max_ratio is None else torch.maximum(self.max_ratio, ratio)
        return loss, dict(stats, logprob_diff_total=diff.sum(), logprob_diff_count=mask.sum(), **sums)


def inline_proximal(loss_fn, correction) -> LossFn:
    """``loss_fn`` (a LossFn or a plain callable) as an ``InlineProximal`` loss; its ``fn`` keeps ``max_diff`` and
    ``max_ratio``. ``correction``: a Correction, or a number: token-level TIS with that cap (0 = no weights). The
    head's token function is kept for token-level corrections (their weights come from its own log-probs); a
    sequence-level one needs the whole microbatch's log-probs, so the trainer computes the loss from them."""
    loss_fn = LossFn.of(loss_fn)
    if not isinstance(correction, Correction):
        correction = Correction("tis", cap=float(correction))
    token_loss = None
    if loss_fn.token_loss is not None and not correction.sequence_level:
        inline_weights = correction.weights if correction.weighs else None
        token_loss = lambda packed, norms: loss_fn.token_loss(packed, norms, inline_weights=inline_weights)  # noqa: E731
    return LossFn(InlineProximal(loss_fn, correction), token_loss=token_loss)


def correction_of(cfg) -> Correction:
    """The run's correction for ``cfg.algo``: GSPO takes seq-tis only (its default, tis, leaves it unweighted)."""
    correction = Correction.of(cfg)
    if cfg.algo == "gspo" and correction.kind != "seq-tis":
        return Correction("tis", cap=0.0)
    return correction


def gspo_loss_fn(cfg) -> LossFn:
    """GSPO's sequence-level loss; with --off-policy-correction seq-tis each sequence's term is weighted by its rows'
    ``tis`` extras (one value per sequence)."""
    seq_tis = cfg.off_policy_correction == "seq-tis"

    def fn(out, packed, norms):
        seq_weight = None
        if seq_tis and "tis" in packed.tok:
            keep = packed.mask > 0
            seq_weight = packed.tok["tis"].new_zeros(packed.num_rows).index_put_(
                (packed.seq_index[keep],), packed.tok["tis"][keep])
        return gspo_loss(
            out.logprobs, packed.old_logprobs, packed.seq_advantages, packed.mask, packed.seq_index,
            num_rows=packed.num_rows, num_seqs=norms.num_seqs, clip_low=cfg.gspo_clip_eps,
            clip_high=cfg.gspo_clip_eps * 4 / 3, ref_logp=packed.tok.get("ref"), kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator, num_tokens=norms.num_tokens, seq_weight=seq_weight,
        )

    return LossFn(fn)


def dpo_loss_fn(cfg) -> LossFn:
    """Rows come in adjacent (chosen, rejected) pairs; each row's ``extras['ref']`` is its summed reference
    log-prob over the response."""

    def fn(out, packed, norms):
        sums = torch.zeros(packed.num_rows, dtype=torch.float32, device=out.logprobs.device)
        sums.index_add_(0, packed.seq_index, out.logprobs * packed.mask)
        ref = packed.row["ref"]
        return dpo_loss(sums[0::2], sums[1::2], ref[0::2], ref[1::2], beta=cfg.dpo_beta,
                        label_smoothing=cfg.dpo_label_smoothing, num_pairs=norms.num_seqs / 2)

    return LossFn(fn)

