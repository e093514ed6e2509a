"""A speculative verify's n tokens per sequence through one state pool's decode step, token by token: the native
path of the verify kernels (``gdn_verify_steps``, ``fused_recurrent_gated_delta_rule_verify``) and the short conv's
verify (its state is small: 49 KB a layer at Qwen3.5-9B); and the replay that commits a verify's accepted tokens.

A verify given ``keep`` (a ``VerifyInputs``) writes no state: the pool keeps each sequence's state from before the
step, the verify's per-token inputs are kept, and once the drafts are judged ``VerifyInputs.replay`` runs each
sequence's accepted tokens on its state (read once, written once). Keeping the state after every token instead (a
stash of n - 1 states, the last in the pool, a rejecting sequence's copied back) wrote each state n times and read
and wrote it again on a rejection: at Qwen3.5-9B's 24 layers of 2 MB fp32 states, a verify of 64 sequences x 3
tokens spent 6.9 ms in the kernel and 2 ms copying (H100, 12-07) where reading it once and writing it once is ~3.
"""

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


def step_aside(n: int, state, state_indices, step, *rows):
    """``step_through`` on a copy of the sequences' states, the pool left as it was: ``step(pool, indices,
    *token_rows)`` steps the copy (row b of it is sequence b's; -1 rows skipped as in the pool)."""
    B = state_indices.shape[0]
    aside = state.index_select(0, state_indices.clamp(min=0).long())
    idx = torch.where(state_indices >= 0, torch.arange(B, device=state.device, dtype=state_indices.dtype), -1)
    return step_through(n, aside, None, idx, lambda *x: step(aside, idx, *x), *rows)


def replay_through(n: int, state_indices, counts, step, *rows) -> None:
    """The first ``counts[b]`` of sequence b's ``n`` token rows through ``step(indices, *token_rows)`` on the pool, in
    order (token i steps the sequences with more than i accepted: the others at index -1, skipped)."""
    per = [x.view(-1, n, *x.shape[1:]) for x in rows]
    for i in range(n):
        step(torch.where(counts > i, state_indices, -1), *(x[:, i] for x in per))


class VerifyInputs:
    """One recurrent layer's inputs of a speculative verify, kept for its replay (the module docstring): buffers of
    ``rows`` token rows (every verify of the engine, its largest batch x (K + 1)), allocated at a layer's first
    verify (before any graph is captured: the capture's warm-up runs first) and rewritten by each verify, graphed
    or not; ``replay(pool, state_indices [B], counts [B])`` commits the last verify's first counts[b] tokens of each
    of its B sequences (the layer's own parameters bound by its kernel's launcher)."""

    def __init__(self, rows: int):
        self.rows, self.bufs, self.fn, self.n = rows, {}, None, 0

    def keep(self, n: int, fn, **tensors) -> dict:
        """Copy each ``[T, ...]`` tensor into its buffer (T = B x n rows) and bind ``fn(pool, state_indices, counts,
        n, **buffers)``, the layer's replay; returns the buffers."""
        for name, x in tensors.items():
            buf = self.bufs.get(name)
            if buf is None or buf.shape[1:] != x.shape[1:] or buf.dtype != x.dtype or buf.device != x.device:
                buf = self.bufs[name] = torch.empty(self.rows, *x.shape[1:], dtype=x.dtype, device=x.device)
            if x.shape[0] > self.rows:
                raise RuntimeError(f"a verify of {x.shape[0]} token rows past the {self.rows} kept for its replay")
            buf[: x.shape[0]].copy_(x)
        self.fn, self.n = fn, n
        return self.bufs

    def replay(self, pool, state_indices, counts) -> None:
        if self.fn is None:
            raise RuntimeError("VerifyInputs.replay before any verify kept its inputs")
        t = state_indices.shape[0] * self.n
        self.fn(pool, state_indices, counts, self.n, **{k: v[:t] for k, v in self.bufs.items()})
