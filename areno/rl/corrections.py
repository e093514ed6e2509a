"""Off-policy corrections (--off-policy-correction): per-token weights from the behaviour/trainer log-ratio, and the
mismatch metrics.

The rollout (behaviour policy mu) and the trainer (pi) disagree on the sampled tokens: different kernels, precision,
or an older policy. With ``log_ratio = log pi - log mu`` per token (trainer minus rollout), each correction gives a
detached per-token weight that multiplies the token's policy-gradient term (or, CISPO, changes the term itself):

- ``tis``: token-level truncated IS, ``min(r_t, cap)`` (--tis-cap);
- ``seq-tis``: sequence-level truncated IS, ``min(prod_t r_t, cap)`` on every token of the sequence;
- ``mask``: masked IS, a 0/1 weight: a token is dropped when its ratio is outside [low, high], a whole sequence when
  its geometric-mean ratio ``exp(mean_t log r_t)`` is (--is-mask-low, --is-mask-high);
- ``icepop``: two-sided token masking, ``r_t`` inside [low, high] and 0 outside (IcePop's M(r));
- ``cispo``: no weight here; the loss is CISPO's ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi``
  (``cispo_terms``), with r the ratio to the rollout's log-probs.

Every function takes flattened packed tensors (``[T]``), the 0/1 ``mask`` of the tokens that count and, for the
sequence-level ones, ``seq_index [T]`` and ``num_rows`` (as areno.rl.losses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from areno.config.constants import SEQUENCE_CORRECTIONS


def _seq_sum(x: torch.Tensor, seq_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    return torch.zeros(num_rows, dtype=x.dtype, device=x.device).index_add_(0, seq_index, x)


def token_tis(log_ratio, mask, cap: float) -> torch.Tensor:
    """Token-level truncated IS: ``min(exp(log_ratio), cap)`` on the counted tokens."""
    return torch.exp(log_ratio).clamp(max=cap) * mask


def sequence_tis(log_ratio, mask, seq_index, num_rows: int, cap: float) -> torch.Tensor:
    """Sequence-level truncated IS: ``min(prod_t r_t, cap)`` of each sequence on each of its counted tokens (the
    product is taken in log space and clamped before exp, so a long sequence cannot overflow)."""
    seq = _seq_sum(log_ratio * mask, seq_index, num_rows)
    return torch.exp(seq.clamp(max=math.log(cap)))[seq_index] * mask


def _inside(ratio, low: float, high: float) -> torch.Tensor:
    return ((ratio >= low) & (ratio <= high)).to(ratio.dtype)


def masked_is(log_ratio, mask, seq_index, num_rows: int, low: float, high: float) -> torch.Tensor:
    """Masked IS: 1 for a counted token whose ratio is inside [low, high] and whose sequence's geometric-mean ratio
    is inside [low, high] too; 0 otherwise (token and sequence masks)."""
    counts = _seq_sum(mask, seq_index, num_rows).clamp(min=1)
    seq_ratio = torch.exp(_seq_sum(log_ratio * mask, seq_index, num_rows) / counts)
    return _inside(torch.exp(log_ratio), low, high) * _inside(seq_ratio, low, high)[seq_index] * mask


def icepop(log_ratio, mask, low: float, high: float) -> torch.Tensor:
    """IcePop: the token ratio where it is inside [low, high], 0 (no gradient) where it is outside."""
    ratio = torch.exp(log_ratio)
    return ratio * _inside(ratio, low, high) * mask


def cispo_terms(logp, old_logp, advantages, clip_low: float, clip_high: float):
    """CISPO (MiniMax-M1): per-token ``-sg(clip(r, 1 - low, 1 + high)) * A * logp`` with ``r = exp(logp -
    old_logp)``: every token keeps a gradient, its IS weight clipped. Returns (pg, ratio, clip_frac)."""
    ratio = torch.exp(logp - old_logp)
    weight = ratio.detach().clamp(1 - clip_low, 1 + clip_high)
    pg = -advantages * weight * logp
    clip_frac = (weight != ratio.detach()).to(logp.dtype)
    return pg, ratio, clip_frac


@dataclass(frozen=True)
class Correction:
    """The run's correction: its kind (a name of OFF_POLICY_CORRECTIONS), the truncation cap (tis, seq-tis; 0 = no
    weights) and the mask bounds (mask, icepop)."""

    kind: str = "tis"
    cap: float = 0.0
    low: float = 0.5
    high: float = 2.0

    @classmethod
    def of(cls, cfg) -> Correction:
        return cls(cfg.off_policy_correction, cfg.tis_cap, cfg.is_mask_low, cfg.is_mask_high)

    @property
    def sequence_level(self) -> bool:
        """Whether a token's weight depends on the rest of its sequence (no per-token head function then)."""
        return self.kind in SEQUENCE_CORRECTIONS

    @property
    def weighs(self) -> bool:
        """Whether it gives per-token weights (``weights`` is not None)."""
        return self.kind in ("mask", "icepop") or (self.kind in ("tis", "seq-tis") and self.cap > 0)

    def weights(self, log_ratio, mask, seq_index=None, num_rows: int = 1) -> torch.Tensor | None:
        """The detached per-token weights (None: no weights: cispo, or tis/seq-tis with cap 0)."""
        if not self.weighs:
            return None
        log_ratio = log_ratio.detach()
        if self.kind == "tis":
            return token_tis(log_ratio, mask, self.cap)
        if self.kind == "icepop":
            return icepop(log_ratio, mask, self.low, self.high)
        if seq_index is None:  # one sequence
            seq_index = torch.zeros(log_ratio.shape, dtype=torch.long, device=log_ratio.device)
        if self.kind == "seq-tis":
            return sequence_tis(log_ratio, mask, seq_index, num_rows, self.cap)
        return masked_is(log_ratio, mask, seq_index, num_rows, self.low, self.high)


def mismatch_sums(log_ratio, mask, weights) -> dict:
    """Detached sums over the counted tokens: ``is_ratio_total`` (r), ``masked_total`` (tokens a correction gave
    weight 0), ``mismatch_kl_total`` (k3 estimate of KL(behaviour || trainer) from the behaviour's samples:
    r - 1 - log r), ``mismatch_tokens``; and ``is_ratio_max`` (a device scalar)."""
    log_ratio, mask = log_ratio.detach(), mask.detach()
    ratio = torch.exp(log_ratio)
    keep = mask > 0
    masked = torch.zeros((), device=mask.device) if weights is None else ((weights == 0) & keep).sum()
    return {
        "is_ratio_total": (ratio * mask).sum(),
        "masked_total": masked.to(mask.dtype),
        "mismatch_kl_total": ((torch.expm1(log_ratio) - log_ratio) * mask).sum(),
        "mismatch_tokens": mask.sum(),
        "is_ratio_max": ratio[keep].max() if bool(keep.any()) else ratio.new_zeros(()),
    }


def mismatch_metrics(totals: dict, ratio_max: float) -> dict:
    """The step's metrics from ``mismatch_sums``' totals (summed over microbatches and ranks) and the largest ratio."""
    n = max(float(totals["mismatch_tokens"]), 1.0)
    return {"is_ratio_mean": float(totals["is_ratio_total"]) / n, "is_ratio_max": float(ratio_max),
            "masked_frac": float(totals["masked_total"]) / n, "mismatch_kl": float(totals["mismatch_kl_total"]) / n}


def row_version(row, batch_version: int | None) -> int | None:
    """The policy version of a row's oldest token: the least of its per-token ``versions`` (partial rollout), else its
    own ``meta['policy_version']``, else the batch's; None: sampled with the current weights (colocated)."""
    if row.versions:
        return min(row.versions)
    version = row.meta.get("policy_version", batch_version)
    return None if version is None else int(version)


def version_lag(rows, step_index: int, batch_version: int | None) -> dict:
    """``policy_version_lag_mean/max``: how many optimizer steps older than the trained policy the policy that sampled
    each row (its oldest token) was (``row_version``); colocated rollout samples with the current weights: lag 0."""
    lags = [0 if (v := row_version(r, batch_version)) is None else step_index - v for r in rows]
    if not lags:
        return {"policy_version_lag_mean": 0.0, "policy_version_lag_max": 0.0}
    return {"policy_version_lag_mean": sum(lags) / len(lags), "policy_version_lag_max": float(max(lags))}


def drop_stale(rows, step_index: int, batch_version: int | None, max_staleness: int) -> tuple[list, int]:
    """--max-staleness K, per sample: the rows whose oldest token is at most K versions older than the trained policy,
    and how many were dropped."""
    kept = [r for r in rows if (v := row_version(r, batch_version)) is None or step_index - v <= max_staleness]
    return kept, len(rows) - len(kept)
