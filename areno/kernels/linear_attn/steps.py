"""A speculative verify's n tokens per sequence through one state pool's decode step, token by token: the native
path of the verify kernels (``gdn_verify_steps``, ``fused_recurrent_gated_delta_rule_verify``) and the short conv's
verify (its state is small: 49 KB a layer at Qwen3.5-9B)."""

from __future__ import annotations

import torch


def step_through(n: int, state, stash, state_indices, step, *rows):
    """Each sequence's ``n`` tokens sit in consecutive rows of ``rows`` (``state_indices [B]`` one pool row per
    sequence, -1 a padding row); ``step(*token_rows)`` (one decode step, the pool ``state`` updated in place) runs for
    token 0, 1, ... in order, as n decode steps would, through the same kernel (so a verify computes what plain
    decoding does); ``stash [n - 1, >= B, ...]`` (or None) gets the state after each of the first n - 1 (the
    rollback's). Returns the steps' outputs in the rows' order."""
    per = [x.view(-1, n, *x.shape[1:]) for x in rows]
    out = []
    for i in range(n):
        out.append(step(*(x[:, i] for x in per)))
        if stash is not None and i < n - 1:
            torch.index_select(state, 0, state_indices.clamp(min=0), out=stash[i, : per[0].shape[0]])
    return torch.stack(out, 1).flatten(0, 1)
