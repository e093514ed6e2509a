"""``linear_logprobs``: per-token log-probabilities (and entropy) of a linear LM head without the [tokens, vocab]
logits, forward statistics in tiles and a recomputed backward (the kernels and the math: ``core``), with vocab
tensor parallelism; ``reference_linear_logprobs`` is the full-logits oracle."""

from __future__ import annotations

import torch

from areno.kernels.logprobs import core


def merge_across_ranks(m, s, a, tz, group):
    """Merge each rank's (m, s, a, tz) of its vocab shard into the statistics of the whole vocab (every rank)."""
    import torch.distributed as dist

    big = m.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
    w = torch.exp(m - big)
    sums = torch.stack([w * s, w * (a + (m - big) * s), tz])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return big, sums[0], sums[1], sums[2]


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, want_entropy, chunk_rows, group, triton_path, opts):
        vocab_start = 0
        if group is not None:
            import torch.distributed as dist

            vocab_start = dist.get_rank(group) * weight.shape[0]
        if triton_path:
            parts = core.triton_stats(hidden, weight, targets, vocab_start, inv_temp, want_entropy, opts.tma)
        else:
            parts = core.native_stats(hidden, weight, targets, vocab_start, inv_temp, chunk_rows)
        m, s, a, tz = core.merge(parts)
        if group is not None:
            m, s, a, tz = merge_across_ranks(m, s, a, tz, group)
        log_s = torch.log(s)
        lse = m + log_s
        ent = log_s - a / s
        ignore = targets < 0
        logprobs = torch.where(ignore, torch.zeros_like(lse), tz - lse)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.cfg = (vocab_start, inv_temp, chunk_rows, group, triton_path, opts)
        ctx.set_materialize_grads(False)
        return logprobs, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        vocab_start, inv_temp, chunk_rows, group, triton_path, opts = ctx.cfg
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (need_dh or need_dw):
            return (None,) * 9
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        g_lp = torch.where(targets < 0, torch.zeros_like(g_lp), g_lp).contiguous()
        g_ent = None if g_ent is None else g_ent.to(lse.dtype).contiguous()
        dh, dw = core.recompute_grads(hidden, weight, targets, vocab_start, inv_temp, lse, ent, g_lp, g_ent, need_dh,
                                      need_dw, chunk_rows, triton_path, opts)  # fmt: skip
        if dh is not None and group is not None:
            import torch.distributed as dist

            dist.all_reduce(dh, group=group)
        dh = None if dh is None else dh.to(hidden.dtype)
        dw = None if dw is None else dw.to(weight.dtype)
        return dh, dw, None, None, None, None, None, None, None


def linear_logprobs(hidden, weight, targets, *, temperature=1.0, return_entropy=False, chunk_size=None, tp_group=None,
                    _loads="auto", _bwd_chunk=None):
    """log softmax(hidden @ weight.T / temperature)[targets] in fp32, tile by tile (see the module docstring).

    hidden ``[..., H]``, weight ``[V, H]`` (same dtype), targets int ``[...]`` in ``[0, V)`` or -100 (ignored: logprob
    0 and no gradient through it; its entropy is still computed and differentiable, mask it in the loss).
    Returns fp32 ``logprobs [...]`` (fp64 for fp64 inputs), or ``(logprobs, entropy)`` with ``return_entropy``.
    ``chunk_size``: tokens per chunk of the recomputation (both paths) and of the native forward; default: sized
    to a fixed memory budget. ``tp_group``: vocab parallel; ``weight`` is this rank's contiguous row shard
    (rows ``rank * V_local`` onwards, equal shards), ``targets`` are global ids, the results equal the unsharded
    call, the gradient of ``weight`` is the local shard's and the gradient of ``hidden`` is summed over ranks.
    ``_loads``, ``_bwd_chunk``: the Triton path's variants a benchmark compares (``core.options``).
    """
    h2, w, t, path = core.flat_inputs(hidden, weight, targets, temperature, "linear_logprobs")
    opts = core.options(h2, w, path, loads=_loads, bwd_chunk=_bwd_chunk)
    lead = targets.shape
    lp, ent = _LinearLogprobs.apply(h2, w, t, 1.0 / float(temperature), return_entropy, chunk_size, tp_group, path,
                                    opts)
    if return_entropy:
        return lp.reshape(lead), ent.reshape(lead)
    return lp.reshape(lead)


def reference_linear_logprobs(hidden, weight, targets, *, temperature=1.0):
    """The plain full-logits computation (the test oracle; use float64 inputs): returns (logprobs, entropy)."""
    logits = (hidden @ weight.T) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    ignore = targets < 0
    lp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(ignore, torch.zeros_like(lp), lp)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy
