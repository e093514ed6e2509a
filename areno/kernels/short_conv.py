"""Short causal depthwise convolution (the q/k/v conv of KDA, Mamba-style): Triton forward/backward, native
reference, autograd, decode update, dispatch.

Per sequence and channel d, with width W and x_s for s < 0 taken from the state (zeros if none):

    y_t[d] = act(bias[d] + sum_{j=0}^{W-1} weight[d, j] * x_{t-(W-1)+j}[d])      act = silu or identity

This is F.conv1d(x, weight[:, None], padding=W-1, groups=D)[..., :L] as transformers' ``causal_conv1d_fn`` runs it:
fp32 math, output in x's dtype. A state [N, D, W-1] holds the last W-1 inputs of a sequence in time order (state[...,
-1] is the newest); the final state of a sequence shorter than W-1 keeps the older inputs of its initial state.
x is packed varlen [T, D] with cu_seqlens int32 [N+1] (None: one sequence).
Bytes: the forward reads x once (the W-1 halo rows are re-read from cache) and writes y once: 2 * T * D * bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areno.kernels.dispatch import use_triton

__all__ = ["causal_conv1d", "causal_conv1d_update", "causal_conv1d_native", "causal_conv1d_update_native"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ACTS = (None, "silu", "swish")


def _act(y, activation):
    return F.silu(y) if activation in ("silu", "swish") else y


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------------------
# Native reference


def causal_conv1d_native(x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None,
                         output_final_state=False):
    """Per-sequence F.conv1d in fp32 (float64 for float64 x); differentiable; host-syncs on cu_seqlens."""
    T, D = x.shape
    W = weight.shape[1]
    f = _compute_dtype(x)
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    w = weight.to(f)[:, None, :]
    b = bias.to(f) if bias is not None else None
    ys, finals = [], []
    for n in range(len(cu) - 1):
        xs = x[cu[n]:cu[n + 1]].to(f).t()  # [D, L]
        head = initial_state[n].to(f) if initial_state is not None else xs.new_zeros(D, W - 1)
        full = torch.cat([head, xs], dim=1)  # [D, W-1+L]
        y = F.conv1d(full[None], w, b, groups=D)[0]  # valid conv: L outputs
        ys.append(_act(y, activation).t())
        finals.append(full[:, full.shape[1] - (W - 1):])
    y = torch.cat(ys).to(x.dtype) if ys else x.new_zeros(0, D)
    final = torch.stack(finals) if output_final_state else None
    if final is not None and initial_state is not None:
        final = final.to(initial_state.dtype)
    elif final is not None:
        final = final.to(x.dtype)
    return y, final


def causal_conv1d_update_native(x, conv_state, weight, bias=None, *, activation="silu", state_indices=None):
    """One token per row: y [B, D]; conv_state rows (slots state_indices[b], -1 skipped) shift left and take x.
    No host sync (CUDA-graph capturable)."""
    f = _compute_dtype(x)
    if state_indices is None:
        old = conv_state
    else:
        ok = state_indices >= 0
        slot = state_indices.long().clamp(min=0)
        old = conv_state.index_select(0, slot)
    window = torch.cat([old.to(f), x.to(f)[:, :, None]], dim=-1)  # [B, D, W]
    y = (window * weight.to(f)).sum(-1)
    if bias is not None:
        y = y + bias.to(f)
    y = _act(y, activation).to(x.dtype)
    new = window[:, :, 1:].to(conv_state.dtype)
    if state_indices is None:
        conv_state.copy_(new)
        return y
    # Skipped rows rewrite the first valid row's slot with its value (or slot 0 with its own), so no write races.
    new = torch.where(ok[:, None, None], new, old)
    j = torch.argmax(ok.to(torch.int32))
    conv_state.index_copy_(0, torch.where(ok, slot, slot[j]), torch.where(ok[:, None, None], new, new[j]))
    return torch.where(ok[:, None], y, 0)


# ---------------------------------------------------------------------------------------------------------------
# Public entry points


def _check(x, weight, bias, activation, initial_state, cu_seqlens):
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"causal_conv1d: x must be [T, D] and weight [D, W] with W >= 2, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[1],):
        raise ValueError(f"causal_conv1d: bias must be [D], got {tuple(bias.shape)}")
    if activation not in _ACTS:
        raise ValueError(f"causal_conv1d: activation must be 'silu' or None, got {activation!r}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"causal_conv1d: x must be a float tensor, got {x.dtype}")
    n = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    W = weight.shape[1]
    if initial_state is not None and tuple(initial_state.shape) != (n, x.shape[1], W - 1):
        raise ValueError(f"causal_conv1d: initial_state must be [N={n}, D, W-1={W - 1}], got "
                         f"{tuple(initial_state.shape)}")


def causal_conv1d(x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None,
                  output_final_state=False):
    """Causal depthwise conv over packed varlen x [T, D] with weight [D, W] (math in the module docstring).

    Returns (y [T, D] in x's dtype, final_state [N, D, W-1] (initial_state's dtype, else x's) or None).
    Differentiable in x, weight, bias and initial_state.
    """
    _check(x, weight, bias, activation, initial_state, cu_seqlens)
    if use_triton(x, weight, supported=False):
        raise NotImplementedError  # the Triton path lands in the next commit
    return causal_conv1d_native(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                initial_state=initial_state, output_final_state=output_final_state)


def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation="silu", state_indices=None):
    """Decode step: x [B, D], conv_state [S, D, W-1] updated in place (S == B without state_indices; with
    state_indices int [B], row b uses slot state_indices[b], -1 skipped with output 0). Returns y [B, D]."""
    if x.dim() != 2 or conv_state.dim() != 3 or conv_state.shape[1:] != (x.shape[1], weight.shape[1] - 1):
        raise ValueError(f"causal_conv1d_update: x must be [B, D] and conv_state [S, D, W-1], got "
                         f"{tuple(x.shape)}, {tuple(conv_state.shape)} (weight {tuple(weight.shape)})")
    if activation not in _ACTS:
        raise ValueError(f"causal_conv1d_update: activation must be 'silu' or None, got {activation!r}")
    if state_indices is None and conv_state.shape[0] != x.shape[0]:
        raise ValueError(f"causal_conv1d_update: conv_state has {conv_state.shape[0]} rows for batch {x.shape[0]} "
                         "(pass state_indices to address a pool)")
    with torch.no_grad():
        return causal_conv1d_update_native(x, conv_state, weight, bias, activation=activation,
                                           state_indices=state_indices)
