"""What a trainer update hands its loss, and the loss it takes: ``ForwardOut``, ``Norms`` and ``LossFn``.

A ``LossFn`` is the loss function ``fn(out: ForwardOut, packed: Packed, norms: Norms) -> (loss, stats)`` with its
capabilities as fields (never attributes found on the function):

- ``token_weights(packed, norms) -> [T]``: the loss is linear in the log-probs (SFT) with these per-token weights;
  the trainer then takes the head's gradient in the forward (``linear_logprobs_loss``), eagerly and in CUDA graphs;
- ``token_loss(packed, norms) -> f(logp, start, end)``: the loss is a function of each token's own log-prob (GRPO,
  PPO); the trainer runs the head as ``linear_logprobs_loss`` with this token function (eager microbatches only).

Either way ``fn`` receives the head's loss as ``ForwardOut.loss`` and must return it as its own. Neither applies
with entropy, a TP group or a value model (the trainer then runs ``linear_logprobs`` and ``fn`` computes the loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ForwardOut:
    logprobs: torch.Tensor | None  # fp32 [T], 0 where targets == -100
    entropy: torch.Tensor | None
    hidden: torch.Tensor | None = None
    values: torch.Tensor | None = None  # a value model's V(s_t), fp32 [T]
    loss: torch.Tensor | None = None  # linear_logprobs_loss's loss, its gradient already taken (logprobs carry none)


@dataclass
class Norms:
    """Counts over the whole optimizer update (all microbatches, all data-parallel ranks)."""

    num_tokens: float
    num_seqs: float


@dataclass(frozen=True)
class LossFn:
    """A loss over one packed microbatch and what the trainer may do with it (see the module docstring)."""

    fn: Callable  # (out: ForwardOut, packed: Packed, norms: Norms) -> (loss, stats)
    token_weights: Callable | None = None  # (packed, norms) -> [T] weights: linear in the log-probs
    token_loss: Callable | None = None  # (packed, norms) -> token function for linear_logprobs_loss

    def __call__(self, out, packed, norms):
        return self.fn(out, packed, norms)

    @classmethod
    def of(cls, loss) -> LossFn:
        """``loss`` as a LossFn: a plain callable has no capability."""
        return loss if isinstance(loss, LossFn) else cls(loss)
