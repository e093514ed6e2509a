"""A loss of the per-token log-probs of an LM head, token by token, with its gradient taken during the forward.

    loss = sum_t f_t(logprob_t),    logprob_t = log softmax(hidden_t @ weight.T / T)[target_t]

with f_t(x) = w_t x (a weight per token: SFT's -mask / tokens) or any function of each token's own log-prob (a
policy-gradient surrogate: GRPO/PPO's clipped ratio against the rollout's log-prob, KL to a reference). Its
derivative at each log-prob is known as soon as that log-prob is, so the gradients of hidden and weight need not
wait for the backward. ``linear_logprobs`` spends one GEMM-equivalent on its forward
statistics and three in its backward (logits recomputed, dhidden, dweight); this spends three in all. Per chunk of
token rows (each over the whole vocab):

1. the statistics kernel of ``linear_logprobs`` also writes q = e^(z - r) for every logit (bf16 for bf16 weights),
   relative to a per-row reference r known before the pass: the target logit (one gathered dot product per row).
   So p = q e^(r - lse) with one factor per row, none per tile. The target column's q is written as 0.
2. lse and log-probs from the merged statistics, then f_t and w_t = f_t'(logprob_t) (autograd over the chunk for a
   function). A row with a weight whose max logit exceeds r by more than
   ``Q_EXP_CAP`` (its target's log-prob is below about -40, where q would pass the cap) is written again relative to
   its own max by the same kernel in its FIX mode (flagged rows only; a program without one does nothing), so the
   step is exact for every row without a host sync (CUDA-graph safe).
3. dlogits = c (onehot - p) with c = w / T, i.e. c (1 - p_y) at the target and -s q elsewhere, s = c e^(r - lse):
   dhidden = -s (q @ W) + c (1 - p_y) W[y] and dweight += -q^T @ (s hidden) + c (1 - p_y) hidden added at row y:
   two cuBLAS GEMMs, fp32 accumulation; 1 - p_y = -expm1(logprob) in fp32, so a confident target loses nothing to
   the rounding of q.

Other inputs (the native path, fp16) run ``linear_logprobs``' statistics and recomputed backward inside the forward:
the same results with four GEMM-equivalents. The backward returns the stashed gradients times the loss's gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import interpreting, use_triton
from areno.kernels.logprobs import core

_FUSED_DTYPES = (torch.bfloat16, torch.float32)  # q in the weight's dtype; fp16 would overflow at the cap


@triton.jit
def scale_round_kernel(X, S, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    tl.store(OUT + offs, (x * tl.load(S)).to(OUT.dtype.element_ty), mask=mask)


def scale_round(g: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g * s`` (fp32 stashed gradient times the loss's 0-dim gradient) rounded to ``dtype`` in one pass: a
    vectorized Triton pass (torch's mixed-dtype ``mul(out=)`` takes its slow dynamic-cast loop: 0.65 ms for the
    151,936 x 1,024 dweight on the H200, twice the bytes' time)."""
    out = torch.empty_like(g, dtype=dtype)
    s = s.to(g.dtype)
    if use_triton(g, s, out, supported=g.is_contiguous() and g.dtype == torch.float32 and s.numel() == 1):
        block = 64 if interpreting() else 2048
        scale_round_kernel[(triton.cdiv(g.numel(), block),)](g, s, out, g.numel(), BLOCK=block, num_warps=8)
    else:
        torch.mul(g, s, out=out)
    return out


def _chunk_rows(N: int, V: int, chunk_rows, budget: int, on_device: bool) -> int:
    """Rows per chunk: at most ``budget`` q elements, chunks evened out (multiples of 128 on a GPU)."""
    rows = max(1, min(N, chunk_rows or max(128, budget // max(1, V))))
    n = triton.cdiv(N, rows)
    rows = triton.cdiv(N, n)
    return min(N, triton.cdiv(rows, 128) * 128) if on_device and not chunk_rows else rows


def _target_logits(hidden, weight, targets, inv_temp):
    """The reference r per row: hidden . weight[target] / T in fp32 (0 for ignored rows)."""
    rows = weight[targets.clamp(min=0)]
    r = torch.einsum("nh,nh->n", hidden.float(), rows.float()) * inv_temp
    return torch.where(targets >= 0, r, torch.zeros_like(r))


def _token_terms(token_loss, lp, start, end):
    """(sum of f_t over rows [start, end), f_t'(logprob_t) [end - start] fp32) for ``lp`` = those rows' log-probs."""
    if isinstance(token_loss, torch.Tensor):
        w = token_loss[start:end].to(lp.dtype)
        return (lp * w).sum(), w
    with torch.enable_grad():
        x = lp.detach().requires_grad_()
        values = token_loss(x, start, end)
        if values.shape != x.shape:
            raise ValueError(f"linear_logprobs_loss: token_loss returned {tuple(values.shape)} values for "
                             f"{x.shape[0]} tokens")
        total = values.sum()
        (g,) = torch.autograd.grad(total, x, allow_unused=True)
    return total.detach(), torch.zeros_like(lp) if g is None else g


def _fused_triton(hidden, weight, targets, token_loss, inv_temp, chunk_rows, need_dh, need_dw, opts):
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    rows = _chunk_rows(N, V, chunk_rows, opts.chunk * 5 // 2, core.on_device(hidden))
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    dh = torch.empty(N, H, dtype=hidden.dtype, device=dev) if need_dh else None
    dw = None  # fp32, written by the first chunk's GEMM, accumulated by the others
    ref_all = _target_logits(hidden, weight, targets, inv_temp)
    q_buf = torch.empty(rows, V, dtype=weight.dtype, device=dev)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        h_c, t_c, q = hidden[r0:r1], targets[r0:r1], q_buf[: r1 - r0]
        ref = ref_all[r0:r1]
        tma = opts.tma and core.tma_possible(h_c, weight)  # a chunk's first row must stay 16-byte aligned
        parts = core.triton_stats(h_c, weight, t_c, 0, inv_temp, False, tma, store=(q, ref), q_tma=opts.q_tma)
        m, s, _, tz = core.merge(parts)
        lse = m + torch.log(s)
        valid = t_c >= 0
        lp = torch.where(valid, tz - lse, torch.zeros_like(lse))
        logp[r0:r1] = lp
        part, g = _token_terms(token_loss, lp, r0, r1)
        loss += part
        c = torch.where(valid, g.float(), torch.zeros_like(lse)) * inv_temp
        fix = (m - ref > core.Q_EXP_CAP) & (c != 0)
        ref = torch.where(fix, m, ref)
        core.triton_stats(h_c, weight, t_c, 0, inv_temp, False, tma, store=(q, ref), fix=fix.to(torch.int32))
        scale = c * torch.exp(ref - lse)  # p = q e^(r - lse)
        tgt_coef = -torch.expm1(lp) * c  # c (1 - p_y); 0 where c is
        y = t_c.clamp(min=0)
        if need_dh:
            qw = core.matmul_f32(q, weight)
            dh[r0:r1] = (tgt_coef[:, None] * weight[y].float() - scale[:, None] * qw).to(dh.dtype)
        if need_dw:
            hf = h_c.float()
            sh = (-scale[:, None] * hf).to(q.dtype)
            if dw is None:
                dw = core.matmul_f32(q.T, sh)
            else:
                core.accumulate(dw, q.T, sh)
            dw.index_add_(0, y, tgt_coef[:, None] * hf)
    return loss, logp, dh, dw  # dw in fp32: the backward scales and rounds it in one pass


def _generic(hidden, weight, targets, token_loss, inv_temp, chunk_rows, need_dh, need_dw, triton_path, opts):
    """The statistics and the recomputed backward of linear_logprobs, both now (four GEMM-equivalents)."""
    if triton_path:
        parts = core.triton_stats(hidden, weight, targets, 0, inv_temp, False, opts.tma)
    else:
        parts = core.native_stats(hidden, weight, targets, 0, inv_temp, chunk_rows)
    m, s, a, tz = core.merge(parts)
    lse = m + torch.log(s)
    valid = targets >= 0
    logp = torch.where(valid, tz - lse, torch.zeros_like(lse))
    loss, g = _token_terms(token_loss, logp, 0, logp.shape[0])
    g = torch.where(valid, g.to(lse.dtype), torch.zeros_like(lse)).contiguous()
    dh = dw = None
    if need_dh or need_dw:
        dh, dw = core.recompute_grads(hidden, weight, targets, 0, inv_temp, lse, None, g, None, need_dh, need_dw,
                                      chunk_rows, triton_path, opts)  # fmt: skip
    return loss, logp, None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype)


class _LinearLogprobsLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, token_loss, inv_temp, chunk_rows, triton_path, opts):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        args = (hidden, weight, targets, token_loss, inv_temp, chunk_rows, need_dh, need_dw)
        if triton_path and weight.dtype in _FUSED_DTYPES:
            loss, logp, dh, dw = _fused_triton(*args, opts)
        else:
            loss, logp, dh, dw = _generic(*args, triton_path, opts)
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(logp)
        ctx.set_materialize_grads(False)
        return loss, logp

    @staticmethod
    def backward(ctx, g_loss, _g_logp):
        dh, dw = ctx.saved_tensors
        if g_loss is None:
            return (None,) * 8
        out = []
        for g, dtype in zip((dh, dw), ctx.dtypes):  # scaled and rounded to the input's dtype in one pass
            out.append(None if g is None else scale_round(g, g_loss, dtype))
        return (*out, None, None, None, None, None, None)


def linear_logprobs_loss(hidden, weight, targets, token_loss, *, temperature=1.0, chunk_size=None, _loads="auto",
                         _bwd_chunk=None, _q_store="tma"):
    """``(loss, logprobs)`` with ``loss = sum_t f_t(logprobs_t)`` and ``logprobs`` as ``linear_logprobs`` gives them
    (fp32, 0 at targets == -100), the gradients of hidden and weight computed now (module docstring).

    ``token_loss``: a float tensor of weights ``w`` like ``targets`` (f_t(x) = w_t x; not differentiable), or a
    callable ``token_loss(logprobs, start, end)`` taking the log-probs of flattened tokens ``[start, end)`` and
    returning their loss terms (same shape), each a differentiable function of that token's log-prob alone (it is
    called per chunk of tokens; other inputs are constants). Targets of -100 get no gradient whatever f is.
    ``logprobs`` carries no gradient: anything else built on it is a constant to the backward.
    ``chunk_size``: token rows per chunk (default: a fixed memory budget, the backward chunk (``_bwd_chunk``,
    2^28) x 2.5 elements of q: 1.25 GiB in bf16 by default, 4,096 rows at a 151,936 vocab, enough rows for the
    dhidden GEMM to fill an H200 and few fp32 accumulations of dweight). No entropy, no tensor parallelism
    (``linear_logprobs`` has both). ``_loads``, ``_bwd_chunk``, ``_q_store``: the Triton path's variants a benchmark
    compares (``core.options``).
    """
    h2, w, t, path = core.flat_inputs(hidden, weight, targets, temperature, "linear_logprobs_loss")
    weighted = isinstance(token_loss, torch.Tensor)
    if weighted and token_loss.shape != targets.shape:
        raise ValueError(f"linear_logprobs_loss: token_loss weights {tuple(token_loss.shape)} must match targets "
                         f"{tuple(targets.shape)}")
    if weighted and (token_loss.requires_grad or not token_loss.is_floating_point()):
        raise ValueError("linear_logprobs_loss: token_loss weights must be a float tensor without grad")
    if not weighted and not callable(token_loss):
        raise ValueError(f"linear_logprobs_loss: token_loss must be a weight tensor or a callable, not "
                         f"{type(token_loss).__name__}")
    tl_ = token_loss.reshape(-1).contiguous() if weighted else token_loss
    opts = core.options(h2, w, path, loads=_loads, bwd_chunk=_bwd_chunk, q_store=_q_store)
    loss, lp = _LinearLogprobsLoss.apply(h2, w, t, tl_, 1.0 / float(temperature), chunk_size, path, opts)
    return loss, lp.reshape(targets.shape)
