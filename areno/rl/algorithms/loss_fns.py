"""Per-algorithm loss functions (LossFn) in the trainer's ``loss_fn(out, packed, norms) -> (loss, stats)`` form."""

from __future__ import annotations

import torch

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
    """Token-level clipped surrogate; old log-probs are the rollout's. Rows may carry per-token ``tis`` weights and
    ``ref`` log-probs in their extras. A function of each token's own log-prob: its ``token_loss(packed, norms)``
    (policy_token_loss) lets the trainer take the head's gradient in the forward (``ForwardOut.loss``, the same
    value) where no entropy term is asked for."""

    def norm_of(norms):
        return norms.num_tokens if cfg.loss_agg == "token-mean" else norms.num_seqs

    def fn(out, packed, norms):
        loss, stats = policy_loss(
            out.logprobs, packed.old_logprobs, packed.advantages, packed.mask, packed.seq_index,
            num_rows=packed.num_rows, norm=norm_of(norms), clip_low=cfg.clip_eps_low, clip_high=cfg.clip_eps_high,
            dual_clip=dual_clip, loss_agg=cfg.loss_agg, tis_weight=packed.tok.get("tis"),
            ref_logp=packed.tok.get("ref"), kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
            entropy=out.entropy, entropy_coef=cfg.entropy_coef,
        )
        return (loss if out.loss is None else out.loss), stats

    def token_loss(packed, norms, tis_cap=None):
        return policy_token_loss(
            packed.old_logprobs, packed.advantages, packed.mask, packed.seq_index, num_rows=packed.num_rows,
            norm=norm_of(norms), clip_low=cfg.clip_eps_low, clip_high=cfg.clip_eps_high, dual_clip=dual_clip,
            loss_agg=cfg.loss_agg, tis_weight=packed.tok.get("tis"), tis_cap=tis_cap, ref_logp=packed.tok.get("ref"),
            kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
        )

    return LossFn(fn, token_loss=token_loss)


class InlineProximal:
    """A policy loss for one update per rollout batch: the update's forward, detached, gives the trainer's log-probs
    of the rollout tokens (the weights have not moved yet), from which the truncated importance weights (``tis_cap``
    > 0) and the rollout-vs-trainer difference are taken, saving a separate no-grad pass. Adds the stats
    ``logprob_diff_total``/``logprob_diff_count`` (summed over microbatches and ranks); this rank's largest difference
    is kept in ``max_diff`` (a device scalar, None before the first microbatch)."""

    def __init__(self, loss_fn, tis_cap: float):
        self.loss_fn, self.tis_cap, self.max_diff = loss_fn, tis_cap, None

    def __call__(self, out, packed, norms):
        lp = out.logprobs.detach()
        mask = packed.mask > 0
        delta = lp - packed.old_logprobs
        if self.tis_cap > 0:
            packed.tok["tis"] = torch.exp(delta).clamp(max=self.tis_cap) * mask
        loss, stats = self.loss_fn(out, packed, norms)
        diff = delta.abs() * mask  # device scalars only: no host sync per microbatch
        top = diff.max() if diff.numel() else diff.new_zeros(())
        self.max_diff = top if self.max_diff is None else torch.maximum(self.max_diff, top)
        return loss, dict(stats, logprob_diff_total=diff.sum(), logprob_diff_count=mask.sum())


def inline_proximal(loss_fn, tis_cap: float) -> LossFn:
    """``loss_fn`` (a LossFn or a plain callable) as an ``InlineProximal`` loss; its ``fn`` keeps ``max_diff``."""
    loss_fn = LossFn.of(loss_fn)
    token_loss = None
    if loss_fn.token_loss is not None:  # the truncated weights come from the head's own log-probs there too
        cap = tis_cap if tis_cap > 0 else None
        token_loss = lambda packed, norms: loss_fn.token_loss(packed, norms, tis_cap=cap)  # noqa: E731
    return LossFn(InlineProximal(loss_fn, tis_cap), token_loss=token_loss)


def gspo_loss_fn(cfg) -> LossFn:
    def fn(out, packed, norms):
        return gspo_loss(
            out.logprobs, packed.old_logprobs, packed.seq_advantages, packed.mask, packed.seq_index,
            num_rows=packed.num_rows, num_seqs=norms.num_seqs, clip_low=cfg.gspo_clip_eps,
            clip_high=cfg.gspo_clip_eps * 4 / 3, ref_logp=packed.tok.get("ref"), kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator, num_tokens=norms.num_tokens,
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

