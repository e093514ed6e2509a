"""Per-token log-probabilities of a linear LM head without the [tokens, vocab] logits: the shared statistics and
gradient kernels (``core``), ``linear_logprobs`` (``forward``: log-probs and entropy, backward recomputed) and
``linear_logprobs_loss`` (``loss``: a loss of them with its gradient taken during the forward)."""

from areno.kernels.logprobs.forward import linear_logprobs, reference_linear_logprobs
from areno.kernels.logprobs.loss import linear_logprobs_loss

__all__ = ["linear_logprobs", "linear_logprobs_loss", "reference_linear_logprobs"]
