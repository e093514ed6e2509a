"""The automatic gate of speculative decoding (``--speculative-disable-by-batch-size``, vLLM's
``disable_by_batch_size``): a step speculates only while at most N sequences decode in it.

Why: a decode step of B sequences reads every weight once and does 2 x (active parameters) FLOPs per token. While
B is small the step is memory-bound and verifying K + 1 positions per sequence costs about what one position does,
so the accepted drafts are nearly free tokens; once B (K + 1) tokens pass the device's ridge point the step is
compute-bound and the verify costs (K + 1)x a plain step, which the accepted drafts no longer pay for (verl measured
a 50% loss there). Above N a step is a plain decode step: no drafts verified, one token per sequence, decode-mode
attention and the runner's own sampling when nothing else shares the step. The MTP layer's paged K/V must still cover
every position (its catch-up, step 0 of the draft, one layer): ``spec_decode`` defers it for gated decode steps and
runs it in one pass when the gate lifts (see there), so drafting resumes exactly when the batch shrinks again. Drafts
are made at the end of a step only when the next step speculates: when the sequences that will decode in it (every
running sequence with its prompt computed) are at most N.

``auto``: the verify step's tokens per step where it turns compute-bound, T = ridge x (weight bytes a step reads) /
(FLOPs per token), with ridge = peak dense bf16 FLOP/s / memory bandwidth of the device
(``areno.platform.roofline``), and N = max(1, floor(T / (K + 1))). Weight bytes: every parameter the target's
forward reads, in its dtype (embedding rows are gathered, not read whole: the table counts only as a tied LM head);
FLOPs: 2 per parameter and token, a routed expert's weighted by top-k / experts (the experts a token runs). K/V
reads and attention FLOPs are left out (they grow the memory side, so speculation pays a little beyond N). On a
device without a known roofline (the CPU, other GPUs) ``auto`` is ``AUTO_FALLBACK``.
"""

from __future__ import annotations

import logging

from areno.platform.roofline import Roofline, device_roofline

log = logging.getLogger("areno.engine")

AUTO_FALLBACK = 32  # auto's N on a device without a known roofline


def decode_counts(model) -> tuple[float, float]:
    """(bytes of weights one decode step of ``model`` reads, FLOPs per token of its forward); MTP layers excluded."""
    head = model.lm_head_weight
    embed = getattr(getattr(model, "embed_tokens", None), "weight", None)
    expert_share = {}
    for m in model.modules():
        experts = getattr(m, "experts", None)
        if getattr(m, "has_router", False) and experts is not None and getattr(m, "num_experts", 0):
            for p in experts.parameters():
                expert_share[id(p)] = m.top_k / m.num_experts
    nbytes = flops = 0.0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or (p is embed and p is not head):
            continue
        nbytes += p.numel() * p.element_size()
        flops += 2.0 * p.numel() * expert_share.get(id(p), 1.0)
    return nbytes, flops


def auto_threshold(model, k: int, roof: Roofline | None) -> tuple[int, str]:
    """``auto``'s N for ``model`` with K = ``k`` draft tokens on a device of roofline ``roof`` (None: not known),
    and how it was chosen (for the log)."""
    if roof is None:
        return AUTO_FALLBACK, "the fixed value for a device without a known roofline"
    nbytes, flops = decode_counts(model)
    tokens = roof.ridge * nbytes / flops
    n = max(1, int(tokens // (k + 1)))
    return n, (f"{roof.name}: ridge {roof.ridge:.0f} FLOP/byte x {nbytes / 1e9:.2f} GB of weights / "
               f"{flops / 1e9:.2f} GFLOP a token = {tokens:.0f} tokens a step, over K + 1 = {k + 1}")


def resolve_gate(setting, model, k: int, device) -> int | None:
    """The step's largest speculating batch for the engine's setting ("auto" or N >= 0), None: never gated; logged."""
    if setting == "auto":
        n, why = auto_threshold(model, k, device_roofline(device))
        log.info("speculative decoding: speculating while at most %d sequences decode in a step (auto: %s)", n, why)
        return n
    if not setting:
        log.info("speculative decoding: every step speculates (--speculative-disable-by-batch-size off)")
        return None
    log.info("speculative decoding: speculating while at most %d sequences decode in a step", setting)
    return int(setting)
