"""Tiny models whose MTP draft agrees with the target part of the time, for speculative-decoding tests: the target's
embedding scaled up (its residual stream leans on the input token, so it often predicts that token again; the LM
head keeps the unscaled embedding) and the MTP layer set to copy its input token (projection onto the embedding half,
a zero block, the head = the embedding)."""

import torch

from areno.config import SamplingParams
from areno.models.mtp import build_mtp_draft

GATE_PROMPTS = [[5, 9, 13, 200, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11], [42] * 5, [17, 18, 19, 20]]
LATE = [[60, 61, 62], [70, 71, 72, 73, 74]]  # added while the first batch decodes


@torch.no_grad()
def make_echo_model(model, scale: float = 4.0, sharpness: float = 1.0, target_sharpness: float = 1.0,
                    block_scale: float = 0.0):
    """In place: the target echoes its input token often, the MTP draft always proposes it (kept tensors rewritten);
    ``sharpness`` scales the draft's logits (its final norm), so its sampling distribution concentrates on the echo,
    ``target_sharpness`` the target's (temperature-1 tests need both peaked to separate them). ``block_scale`` > 0
    keeps the MTP block's random weights scaled by it (its norms whole) instead of zeroing them: its attention then
    writes and reads real K/V while the draft still mostly echoes."""
    embed = model.embed_tokens.weight
    if model.lm_head is not None:
        model.lm_head.weight.copy_(embed)
    draft = build_mtp_draft(model)
    h = embed.shape[1]
    for block in draft.blocks:
        for p in block.parameters():
            if not block_scale:
                p.zero_()
            elif p.dim() > 1:
                p.mul_(block_scale)
    for proj in draft.proj:
        proj.weight.zero_()
        proj.weight[:, :h] = torch.eye(h)
    for norm in draft.norm:
        norm.weight.fill_(0.0 if hasattr(norm, "scale") else 1.0)
        _scale_norm(norm, sharpness)
    if draft.head is not None:
        for e, head in zip(draft.embed, draft.head):
            head.weight.copy_(e.weight)
    draft.store_kept(model)
    embed.mul_(scale)
    _scale_norm(model.norm, target_sharpness)
    return model


def _scale_norm(norm, factor: float) -> None:
    """Multiply a norm's output by ``factor`` (a zero-centred norm scales by 1 + weight)."""
    if hasattr(norm, "scale"):
        norm.weight.copy_((1.0 + norm.weight) * factor - 1.0)
    else:
        norm.weight.mul_(factor)


def run_with_arrivals(e, news=(3, 6, 10, 20), late=(8, 6), after=8):
    """GATE_PROMPTS with ``news`` new tokens each; after ``after`` steps LATE join (greedy): the batch shrinks below a
    gate of 2, grows past it again and shrinks. Returns every sequence's (tokens, log-probs)."""
    greedy = lambda n: SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)  # noqa: E731
    seqs = [e.add_request(p, greedy(n))[0] for p, n in zip(GATE_PROMPTS, news)]
    for _ in range(after):
        e.step()
    seqs += [e.add_request(p, greedy(n))[0] for p, n in zip(LATE, late)]
    while e.has_work():
        e.step()
    return [(s.output_ids, list(s.logprobs)) for s in seqs]
