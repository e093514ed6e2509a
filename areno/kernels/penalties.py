"""Logit adjustments applied before sampling, in place, per row, graph-capturable (vLLM's semantics).

    sparse  (``apply_logit_bias``):  x[i] += bias[i]                       for the row's listed token ids,
                                     x[i]  = -inf  where banned and the row's ``min_left`` > 0
                                     (``min_tokens``: EOS and stop ids cannot be sampled before it is reached)
    dense   (``apply_penalties``):   x[i]  = x[i] / rep  if x[i] > 0 else x[i] * rep    where i is in the prompt
                                                                                        or the output so far
                                     x[i] -= frequency * count[i] + presence * (count[i] > 0)   (output only)
                                     (then clamped to +-1e30, so that an extreme penalty never makes inf or NaN)

The engine applies the sparse step first (logit_bias, then the min_tokens ban), the dense one second, both on the
raw logits; temperature, min-p, top-k and top-p follow in ``sample``. Rows whose slot is -1 (dense) or whose list
is empty (sparse) are left untouched, so a batch pays only for the rows that ask.

Token state: one int32 row per slot ``[slots, V]``, bits 0-23 the token's count in the output so far, bit 24 set
when the token occurs in the prompt; ``reset_token_state`` fills a slot (at a sequence's first sampled step) and
``record_tokens`` adds each step's sampled tokens (a scatter-add, so it runs inside a CUDA graph).
Traffic of the dense kernel: rows with a slot read the logits and the state row and write the logits back
(12 bytes per vocabulary entry); the sparse one touches only the listed entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import interpreting, use_triton

COUNT_BITS = 24
IN_PROMPT = 1 << COUNT_BITS  # flag bit of the token state: the token occurs in the prompt
_COUNT_MASK = IN_PROMPT - 1
_LIMIT = 1e30  # penalised logits stay within +-1e30 (an extreme penalty must not make inf, then NaN), bans stay -inf
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

# ---------------------------------------------------------------------------------------------- Triton kernels


@triton.jit
def _penalty_kernel(x_ptr, stride_x, slot_ptr, state_ptr, stride_s, rep_ptr, pres_ptr, freq_ptr, V,
                    COUNT_MASK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # grid: rows x vocab blocks; a row without a slot does nothing
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        rep = tl.load(rep_ptr + row)
        pres = tl.load(pres_ptr + row)
        freq = tl.load(freq_ptr + row)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        st = tl.load(state_ptr + slot.to(tl.int64) * stride_s + cols, mask=ok, other=0)
        ptr = x_ptr + row.to(tl.int64) * stride_x + cols
        x0 = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
        count = (st & COUNT_MASK).to(tl.float32)
        x = tl.where(st != 0, tl.where(x0 > 0, x0 / rep, x0 * rep), x0)
        x = x - freq * count - pres * tl.where(count > 0, 1.0, 0.0)
        x = tl.where(x0 == float("-inf"), x0, tl.minimum(tl.maximum(x, -1e30), 1e30))  # _LIMIT
        tl.store(ptr, x.to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bias_kernel(x_ptr, stride_x, ids_ptr, bias_ptr, ban_ptr, stride_b, left_ptr, V, W, BLOCK_W: tl.constexpr):
    # grid: rows; the ids of a row are distinct, so the gathers and stores never collide
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_W)
    ids = tl.load(ids_ptr + row * stride_b + j, mask=j < W, other=-1)
    ok = (j < W) & (ids >= 0) & (ids < V)
    bias = tl.load(bias_ptr + row * stride_b + j, mask=ok, other=0.0)
    ban = tl.load(ban_ptr + row * stride_b + j, mask=ok, other=0)
    left = tl.load(left_ptr + row)
    ptr = x_ptr + row.to(tl.int64) * stride_x + ids
    x = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    x = tl.where((ban != 0) & (left > 0), float("-inf"), x + bias)
    tl.store(ptr, x.to(x_ptr.dtype.element_ty), mask=ok)


def _triton_penalties(logits, slots, state, rep, pres, freq):
    B, V = logits.shape
    block = 128 if interpreting() or not logits.is_cuda else 1024
    _penalty_kernel[(B, triton.cdiv(V, block))](
        logits, logits.stride(0), slots, state, state.stride(0), rep, pres, freq, V, COUNT_MASK=_COUNT_MASK,
        BLOCK=block, num_warps=4)  # fmt: skip


def _triton_bias(logits, ids, bias, ban, left):
    B, V = logits.shape
    W = ids.shape[1]
    _bias_kernel[(B,)](logits, logits.stride(0), ids, bias, ban.view(torch.uint8), ids.stride(0), left, V, W,
                       BLOCK_W=triton.next_power_of_2(max(W, 1)), num_warps=1)  # fmt: skip


# ------------------------------------------------------------------------------------------------ native path


def _native_penalties(logits, slots, state, rep, pres, freq):
    on = slots >= 0
    st = state[slots.clamp(min=0)]
    count = (st & _COUNT_MASK).float()
    x = logits.float()
    rep = torch.where(on, rep, torch.ones_like(rep))[:, None]
    x = torch.where(st != 0, torch.where(x > 0, x / rep, x * rep), x)
    x = x - torch.where(on[:, None], freq[:, None] * count + pres[:, None] * (count > 0).float(), 0.0)
    logits.copy_(torch.where(logits == float("-inf"), logits.float(), x.clamp(-_LIMIT, _LIMIT)))


def _native_bias(logits, ids, bias, ban, left):
    B, V = logits.shape
    ok = (ids >= 0) & (ids < V)
    col = torch.where(ok, ids, V)  # the invalid entries land in a spare column, dropped below
    delta = torch.zeros(B, V + 1, dtype=torch.float32, device=logits.device)
    delta.scatter_(1, col, torch.where(ok, bias.float(), 0.0))
    banned = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
    banned.scatter_(1, col, ok & ban & (left > 0)[:, None])
    logits.copy_(torch.where(banned[:, :V], float("-inf"), logits.float() + delta[:, :V]))


# ------------------------------------------------------------------------------------------------ public API


def _check_rows(name, t, B, dtype=None):
    if t.dim() != 1 or t.shape[0] != B:
        raise ValueError(f"{name} must have one value per row ({B}), got {tuple(t.shape)}")
    return t if dtype is None else t.to(dtype)


def apply_penalties(logits, slots, token_state, repetition, presence, frequency):
    """Repetition, presence and frequency penalties, in place on ``logits [B, V]`` (see the module docstring).

    ``slots`` int ``[B]``: each row's row of ``token_state [S, V]`` int32 (-1: the row has no penalties);
    ``repetition`` (> 0, 1 = off), ``presence`` and ``frequency`` (0 = off) fp32 ``[B]``. Returns ``logits``.
    """
    if logits.dim() != 2 or token_state.dim() != 2 or token_state.shape[1] != logits.shape[1]:
        raise ValueError(f"apply_penalties: logits [B, V] and token_state [S, V], got {tuple(logits.shape)}, "
                         f"{tuple(token_state.shape)}")  # fmt: skip
    if token_state.dtype != torch.int32 or logits.stride(-1) != 1 or token_state.stride(-1) != 1:
        raise ValueError("apply_penalties: token_state must be int32 and both tensors contiguous along V")
    B = logits.shape[0]
    slots = _check_rows("slots", slots, B, torch.int64)
    rep, pres, freq = (_check_rows(n, t, B, torch.float32) for n, t in
                       (("repetition", repetition), ("presence", presence), ("frequency", frequency)))
    if use_triton(logits, supported=logits.dtype in _FLOATS):
        _triton_penalties(logits, slots, token_state, rep, pres, freq)
    else:
        _native_penalties(logits, slots, token_state, rep, pres, freq)
    return logits


def apply_logit_bias(logits, ids, bias, ban=None, min_left=None):
    """Sparse per-row bias and bans, in place on ``logits [B, V]`` (see the module docstring).

    ``ids`` int64 ``[B, W]``: token ids, distinct within a row, -1 (or >= V) for unused entries; ``bias`` fp32
    ``[B, W]`` added to them; ``ban`` bool ``[B, W]``: those entries become -inf while the row's ``min_left`` int
    ``[B]`` is > 0 (``min_left=None``: always). Returns ``logits``.
    """
    if logits.dim() != 2 or ids.dim() != 2 or ids.shape[0] != logits.shape[0] or bias.shape != ids.shape:
        raise ValueError(f"apply_logit_bias: logits [B, V], ids and bias [B, W], got {tuple(logits.shape)}, "
                         f"{tuple(ids.shape)}, {tuple(bias.shape)}")  # fmt: skip
    B, dev = logits.shape[0], logits.device
    ids, bias = ids.to(torch.int64).contiguous(), bias.to(torch.float32).contiguous()
    ban = torch.zeros_like(ids, dtype=torch.bool) if ban is None else ban.to(torch.bool).contiguous()
    left = torch.ones(B, dtype=torch.int32, device=dev) if min_left is None else _check_rows("min_left", min_left, B,
                                                                                             torch.int32)  # fmt: skip
    if logits.stride(-1) != 1:
        raise ValueError("apply_logit_bias: logits must be contiguous along V")
    if use_triton(logits, supported=logits.dtype in _FLOATS):
        _triton_bias(logits, ids, bias, ban, left)
    else:
        _native_bias(logits, ids, bias, ban, left)
    return logits


def reset_token_state(token_state, slot: int, prompt_ids, output_ids) -> None:
    """Fill ``token_state[slot]`` for a sequence: the prompt's flag bits and the counts of its output so far."""
    row = token_state[slot]
    row.zero_()
    dev = row.device
    if len(prompt_ids):
        row[torch.as_tensor(prompt_ids, dtype=torch.int64, device=dev)] = IN_PROMPT
    if len(output_ids):
        out = torch.as_tensor(output_ids, dtype=torch.int64, device=dev)
        row.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))


def record_tokens(token_state, slots, tokens) -> None:
    """Count each row's sampled token in its slot (rows with slot -1 add nothing); graph-capturable."""
    V = token_state.shape[1]
    on = slots >= 0
    flat = torch.where(on, slots.clamp(min=0) * V + tokens, 0)
    token_state.view(-1).scatter_add_(0, flat, on.to(torch.int32))
