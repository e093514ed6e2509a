"""The recurrent state both linear-attention hybrids keep per sequence (Ling 3 / Kimi-Linear's KDA and Qwen3.5's
gated DeltaNet): the short convolution and the gated delta rule over a packed batch, each in its three modes.

- training (no cache): the whole packed rows from zero state;
- prefill (``meta.is_prefill``): each sequence's chunk starts from its slot's carried state (zeros when no tokens
  precede the chunk) and the final state is written back to the slot;
- decode: one step a token on the slot's state; ``meta.tokens_per_seq`` n > 1 (a speculative verify) steps through
  each sequence's n rows in order (the delta rule's n tokens in one kernel that computes what n steps do, the conv's
  through ``kernels.linear_attn.steps.step_through``); with ``meta.state_steps`` the conv's states after the first
  n - 1 are stashed and the delta rule's state left as it was, its inputs kept, for the rollback's replay.

``kv_cache`` is the layer's ``(conv state pool, recurrent state pool)``, indexed by ``meta.state_indices``; the
recurrent pool may be bf16 (``--mamba-ssm-cache-dtype``): the chunked kernel starts from it in fp32 and its final
state is rounded back.
"""

from __future__ import annotations

import torch

from areno.kernels.linear_attn.delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_step,
    fused_recurrent_gated_delta_rule_verify,
)
from areno.kernels.linear_attn.short_conv import causal_conv1d, causal_conv1d_update
from areno.kernels.linear_attn.steps import step_through


def short_conv(mixed, w, meta, kv_cache=None):
    """silu(causal depthwise conv_w(mixed)) over the packed rows (``w [C, W]``), in the mode of the module
    docstring; the conv state pool is ``kv_cache[0]``."""
    if kv_cache is None:
        return causal_conv1d(mixed, w, activation="silu", cu_seqlens=meta.cu_seqlens_q)[0]
    if not meta.is_prefill:
        return conv_decode(mixed, kv_cache[0], w, meta)
    idx, s0 = carried_state(kv_cache[0], meta)
    out, final = causal_conv1d(mixed, w, activation="silu", cu_seqlens=meta.cu_seqlens_q, initial_state=s0,
                               output_final_state=True)
    kv_cache[0].index_copy_(0, idx, final)
    return out


def delta_rule(q, k, v, g, beta, scale, meta, kv_cache=None):
    """The gated delta rule's output over the packed rows (q/k/v in the model dtype, the gates fp32), in the mode of
    the module docstring; the recurrent state pool is ``kv_cache[1]``."""
    if kv_cache is None:
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, cu_seqlens=meta.cu_seqlens_q)[0]
    if not meta.is_prefill:
        return delta_decode(q, k, v, g, beta, kv_cache[1], scale, meta)
    pool = kv_cache[1]
    idx, s0 = carried_state(pool, meta)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, cu_seqlens=meta.cu_seqlens_q,
                                      initial_state=s0.float(), output_final_state=True)
    pool.index_copy_(0, idx, final.to(pool.dtype))
    return o


def carried_state(pool, meta):
    """The state each prefill sequence starts from: its slot's, when tokens precede its chunk, else zeros."""
    idx = meta.state_indices.long()
    q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
    carry = (meta.seq_lens > q_lens).view(-1, *[1] * (pool.dim() - 1))
    return idx, torch.where(carry, pool.index_select(0, idx), torch.zeros((), dtype=pool.dtype, device=pool.device))


def conv_decode(x, state, w, meta):
    """The short-conv decode update; ``meta.tokens_per_seq`` n > 1 (a speculative verify) steps through each
    sequence's tokens in order (``step_through``)."""
    if meta.tokens_per_seq == 1:
        return causal_conv1d_update(x.contiguous(), state, w, activation="silu", state_indices=meta.state_indices)
    stash = None if meta.state_steps is None else meta.state_steps.next("conv")
    return step_through(meta.tokens_per_seq, state, stash, meta.state_indices, lambda xi: causal_conv1d_update(
        xi.contiguous(), state, w, activation="silu", state_indices=meta.state_indices), x)


def delta_decode(q, k, v, g, beta, state, scale, meta):
    """The gated delta-rule decode step; ``meta.tokens_per_seq`` n > 1 (a speculative verify): each sequence's n
    tokens in one kernel, as n decode steps compute them; with ``meta.state_steps`` (the engine's) the states are
    left for the rollback to replay the accepted tokens on, their inputs kept (``fused_recurrent_gated_delta_rule_
    verify`` with ``keep``)."""
    n = meta.tokens_per_seq
    if n == 1:
        return fused_recurrent_gated_delta_rule_step(q, k, v, g, beta, state, scale=scale,
                                                     state_indices=meta.state_indices)  # fmt: skip
    keep = None if meta.state_steps is None else meta.state_steps.next("recurrent")
    return fused_recurrent_gated_delta_rule_verify(q, k, v, g, beta, state, n=n, keep=keep, scale=scale,
                                                   state_indices=meta.state_indices)  # fmt: skip
