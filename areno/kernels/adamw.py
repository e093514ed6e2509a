"""One pass of AdamW over a parameter's fp32 master slice, reading its low-precision gradient and writing the
low-precision parameter: the update of ``MasterAdamW.device_step`` (``areno/training/optimizer.py``).

Per element, with ``g`` the gradient divided by the clip factor ``scale`` (0 for a parameter without a gradient):

    w <- w * (1 - lr * weight_decay)
    m <- m + (g - m) * (1 - beta1)                 (torch.lerp, as torch.optim.AdamW)
    v <- v * beta2 + (1 - beta2) * g * g
    w <- w - step_size * m / (sqrt(v) / bc2_sqrt + eps)
    p <- w rounded to p's dtype

``step_size = lr / (1 - beta1^t)`` and ``bc2_sqrt = sqrt(1 - beta2^t)`` are 0-dim fp32 device tensors computed once
per step (in float64) from the device step count, and ``skip`` (a 0-dim fp32 device tensor, 1 for a non-finite norm
or a dry run) leaves every value as it is, so the whole update runs without a host sync (CUDA-graph capturable).
This is torch's fused AdamW (``grad_scale`` / ``found_inf``) on the master, fused with what ``device_step`` did around
it: the gradient's copy into an fp32 buffer and the rounding of the master into the parameter. Bytes per element:
2 (gradient) + 3 x 4 read + 3 x 4 written + 2 (parameter) = 28, against 46 for the unfused sequence.

Multi-tensor launches (what ``MasterAdamW.device_step`` runs): ``master_adamw_multi_`` updates many parameters in
one launch and ``grad_sumsq`` takes the gradients' sum of squares (the clip norm) in one launch per dtype. Each
program finds its tensor and block in small device tables of addresses (``MultiTensorTable``, built by
``AdamwPlan`` / ``SumsqPlan`` from 16-byte aligned contiguous tensors, so full blocks move in 16-byte vectors;
other tensors go one by one). The tables hold raw addresses: a plan is valid for the tensors it was built from,
which is what a CUDA graph replays (Qwen3-0.6B's 226 parameters: 5.12 -> 4.42 ms graphed, ``bench/optimizer_step.py``).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import interpreting, use_triton

_BLOCK = 1024  # the H200's best per-tensor tiling for T2's parameter sizes (2048 / 8 warps: 3-8% slower)
_MT_BLOCK = 1024  # elements per program of the multi-tensor update
_SQ_BLOCK = 4096  # of the multi-tensor sum of squares


@triton.jit
def adamw_math(w, m, v, g, lr, step_size, bc2_sqrt, beta1, beta2, eps, weight_decay):
    w = w * (1.0 - lr * weight_decay)
    m = m + (g - m) * (1.0 - beta1)
    v = v * beta2 + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps  # IEEE-rounded, as torch's ops
    return w - step_size * tl.div_rn(m, denom), m, v


@triton.jit
def masked_adamw(w, m, v, G, offs, mask, LR, STEP_SIZE, BC2_SQRT, SCALE, beta1, beta2, eps, weight_decay,
                 HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """The AdamW update (``adamw_math``) of one masked block, the gradient read at ``G + offs`` and divided by the
    clip divisor (zeros without a gradient), the scalars read from their device pointers."""
    if HAS_GRAD:
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(SCALE)
    else:
        g = tl.zeros([BLOCK], dtype=tl.float32)
    return adamw_math(w, m, v, g, tl.load(LR), tl.load(STEP_SIZE), tl.load(BC2_SQRT), beta1, beta2, eps,
                       weight_decay)


@triton.jit
def master_adamw_kernel(
    W, M, V, G, P, n, LR, STEP_SIZE, BC2_SQRT, SCALE, SKIP, beta1, beta2, eps, weight_decay,
    HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if tl.load(SKIP) == 0.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(W + offs, mask=mask, other=0.0)
        m = tl.load(M + offs, mask=mask, other=0.0)
        v = tl.load(V + offs, mask=mask, other=0.0)
        w, m, v = masked_adamw(w, m, v, G, offs, mask, LR, STEP_SIZE, BC2_SQRT, SCALE, beta1, beta2, eps, weight_decay,
                               HAS_GRAD, BLOCK)
        tl.store(W + offs, w, mask=mask)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
        tl.store(P + offs, w.to(P.dtype.element_ty), mask=mask)


@triton.jit
def multi_adamw_kernel(
    TABLE, CHUNK_T, FIRST, LR, STEP_SIZE, BC2_SQRT, SCALE, SKIP, beta1, beta2, eps, weight_decay, G_REF, P_REF,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # program c updates block c - FIRST[t] of tensor t = CHUNK_T[c]; TABLE[t] = (w, m, v, g, p addresses, numel),
    # every address 16-byte aligned (the planner checks), so the full blocks load and store in 16-byte vectors
    if tl.load(SKIP) == 0.0:
        c = tl.program_id(0)
        t = tl.load(CHUNK_T + c).to(tl.int64)
        row = TABLE + t * 6
        W = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.float32)), 16)
        M = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.float32)), 16)
        V = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.float32)), 16)
        G = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(G_REF.dtype.element_ty)), 16)
        P = tl.multiple_of(tl.load(row + 4).to(tl.pointer_type(P_REF.dtype.element_ty)), 16)
        n = tl.load(row + 5)
        start = (c - tl.load(FIRST + t)).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        lr, step_size, bc2_sqrt, scale = tl.load(LR), tl.load(STEP_SIZE), tl.load(BC2_SQRT), tl.load(SCALE)
        if start + BLOCK <= n:  # a full block: no mask
            w, m, v = adamw_math(tl.load(W + offs), tl.load(M + offs), tl.load(V + offs),
                                  tl.load(G + offs).to(tl.float32) / scale, lr, step_size, bc2_sqrt, beta1, beta2,
                                  eps, weight_decay)
            tl.store(W + offs, w)
            tl.store(M + offs, m)
            tl.store(V + offs, v)
            tl.store(P + offs, w.to(P.dtype.element_ty))
        else:
            mask = offs < n
            w, m, v = adamw_math(tl.load(W + offs, mask=mask, other=0.0), tl.load(M + offs, mask=mask, other=0.0),
                                  tl.load(V + offs, mask=mask, other=0.0),
                                  tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) / scale, lr, step_size,
                                  bc2_sqrt, beta1, beta2, eps, weight_decay)
            tl.store(W + offs, w, mask=mask)
            tl.store(M + offs, m, mask=mask)
            tl.store(V + offs, v, mask=mask)
            tl.store(P + offs, w.to(P.dtype.element_ty), mask=mask)


@triton.jit
def multi_sumsq_kernel(TABLE, CHUNK_T, FIRST, OUT, X_REF, BLOCK: tl.constexpr):
    # OUT[c] = the fp32 sum of squares of block c - FIRST[t] of tensor t = CHUNK_T[c]; TABLE[t] = (16-byte aligned
    # address, numel)
    c = tl.program_id(0)
    t = tl.load(CHUNK_T + c).to(tl.int64)
    X = tl.multiple_of(tl.load(TABLE + t * 2).to(tl.pointer_type(X_REF.dtype.element_ty)), 16)
    n = tl.load(TABLE + t * 2 + 1)
    start = (c - tl.load(FIRST + t)).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        x = tl.load(X + offs).to(tl.float32)
    else:
        x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(OUT + c, tl.sum(x * x, axis=0))


def bias_corrections(lr: torch.Tensor, step: torch.Tensor, beta1: float, beta2: float):
    """``(step_size, bc2_sqrt)`` as 0-dim fp32 tensors on ``step``'s device, from the step count ``t`` in ``step``
    (after this step's increment) in float64: ``lr / (1 - beta1^t)`` and ``sqrt(1 - beta2^t)``."""
    t = step.double()
    step_size = lr.double() / (1.0 - torch.pow(beta1, t))
    return step_size.float(), torch.sqrt(1.0 - torch.pow(beta2, t)).float()


def master_adamw_native(w, m, v, grad, param, lr, step_size, bc2_sqrt, scale, skip, *, beta1, beta2, eps,
                        weight_decay) -> None:
    """Plain PyTorch reference of the kernel (the test oracle), in place, without a host sync (``skip`` selects the
    old values on the device)."""
    g = torch.zeros_like(w) if grad is None else grad.reshape(-1).to(w.dtype) / scale
    keep = skip != 0
    w1 = w * (1.0 - lr * weight_decay)
    m1 = torch.lerp(m, g, 1.0 - beta1)
    v1 = v * beta2 + (1.0 - beta2) * g * g
    w1 = w1 - step_size * (m1 / (v1.sqrt() / bc2_sqrt + eps))
    for old, new in ((w, w1), (m, m1), (v, v1)):
        old.copy_(torch.where(keep, old, new))
    param.view(-1).copy_(w)


def master_adamw_(w, m, v, grad, param, lr, step_size, bc2_sqrt, scale, skip, *, beta1, beta2, eps,
                  weight_decay) -> None:
    """Update the fp32 master slice ``w`` and moments ``m``, ``v`` (flat, contiguous, ``param.numel()`` elements) in
    place from ``grad`` (``param``'s gradient or None) and write the rounded master into ``param``. ``lr``,
    ``step_size``, ``bc2_sqrt`` (see ``bias_corrections``), ``scale`` (the clip divisor) and ``skip`` are 0-dim fp32
    tensors on the parameter's device. Triton on CUDA (and interpreted), the native reference elsewhere."""
    n = w.numel()
    if n == 0:
        return
    if grad is not None and not grad.is_contiguous():
        grad = grad.contiguous()
    scalars = (lr, step_size, bc2_sqrt, scale, skip)
    ok = (param.is_contiguous() and param.numel() == n == m.numel() == v.numel() and w.dtype == torch.float32
          and (grad is None or grad.numel() == n))
    if not use_triton(w, m, v, param, *scalars, supported=ok):
        master_adamw_native(w, m, v, grad, param, lr, step_size, bc2_sqrt, scale, skip, beta1=beta1, beta2=beta2,
                            eps=eps, weight_decay=weight_decay)
        return
    block = 64 if interpreting() else _BLOCK
    master_adamw_kernel[(triton.cdiv(n, block),)](
        w, m, v, grad if grad is not None else w, param, n, lr, step_size, bc2_sqrt, scale, skip,
        beta1, beta2, eps, weight_decay, HAS_GRAD=grad is not None, BLOCK=block, num_warps=8,
    )  # fmt: skip


# ---- multi-tensor launches: one kernel over many parameters (optimizer-step graphs replay them) ------------------
class MultiTensorTable:
    """The device tables of one multi-tensor launch over a fixed list of tensors: ``rows`` [NT, k] int64 (each
    tensor's addresses and numel), ``chunk_t`` [C] int32 (the tensor each program works on) and ``first`` [NT]
    int32 (each tensor's first program), for blocks of ``block`` elements. Built on the host and copied once; the
    addresses are baked in, so a table is valid only for the very tensors it was built from (a CUDA graph that
    replays the launch holds the same tensors)."""

    def __init__(self, rows: list[list[int]], numels: list[int], block: int, device):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a multi-tensor table is built before a CUDA graph captures its launch, not during it")
        counts = np.asarray([-(-n // block) for n in numels], dtype=np.int64)
        self.programs = int(counts.sum())
        self.rows = torch.tensor(rows, dtype=torch.int64).to(device)
        self.chunk_t = torch.from_numpy(np.repeat(np.arange(len(numels), dtype=np.int32), counts)).to(device)
        self.first = torch.from_numpy((np.cumsum(counts) - counts).astype(np.int32)).to(device)


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def _addresses(items) -> tuple:
    """The identity a plan is valid for: the address of every tensor in ``items`` (tensors, or tuples of tensors
    and Nones), in order."""
    return tuple(_addresses(x) if isinstance(x, tuple) else (0 if x is None else x.data_ptr()) for x in items)


class SumsqPlan:
    """``grad_sumsq``'s launches over ``tensors``: one per dtype over the aligned contiguous ones (``tables``),
    torch's ``_foreach_norm`` over the rest (``rest``)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = list(tensors)  # held: the tables' addresses stay theirs while the plan lives
        self.key = _addresses(self.tensors)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        self.rest: list[torch.Tensor] = []
        triton_ok = bool(tensors) and use_triton(*tensors, supported=all(t.numel() > 0 for t in tensors))
        for t in self.tensors:
            if triton_ok and _aligned(t) and t.dtype in (torch.float32, torch.float16, torch.bfloat16):
                by_dtype.setdefault(t.dtype, []).append(t)
            else:
                self.rest.append(t)
        block = 256 if interpreting() else _SQ_BLOCK
        self.tables = [(group[0], MultiTensorTable([[t.data_ptr(), t.numel()] for t in group],
                                                   [t.numel() for t in group], block, group[0].device), block)
                       for group in by_dtype.values()]


def grad_sumsq(tensors: list[torch.Tensor], plan: SumsqPlan | None = None) -> torch.Tensor:
    """The sum of squares of every element of ``tensors`` as a 0-dim fp64 tensor on their device, without a host
    sync: fp32 sums over blocks of ``_SQ_BLOCK`` elements (one launch per dtype over all the tensors), added in
    fp64. ``plan`` (``SumsqPlan(tensors)``) may be built ahead, e.g. before a CUDA graph captures this; one built for
    other tensors is rebuilt (which a capture refuses)."""
    if plan is None or plan.key != _addresses(tensors):  # none ahead, or built for others
        plan = SumsqPlan(tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    parts = []
    for ref, table, block in plan.tables:
        out = torch.empty(table.programs, dtype=torch.float32, device=device)
        multi_sumsq_kernel[(table.programs,)](table.rows, table.chunk_t, table.first, out, ref, BLOCK=block,
                                              num_warps=8)
        parts.append(out.sum(dtype=torch.float64).reshape(1))
    if plan.rest:
        parts.append(torch.stack(torch._foreach_norm(plan.rest, 2, dtype=torch.float32)).double().square().sum()
                     .reshape(1))
    return torch.cat(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)


class AdamwPlan:
    """``master_adamw_multi_``'s launches over entries ``(w, m, v, grad, param)``: one per (gradient dtype,
    parameter dtype) over those with a gradient and every tensor 16-byte aligned and contiguous; the rest go one
    by one through ``master_adamw_``."""

    def __init__(self, entries: list[tuple]):
        self.entries = list(entries)  # held: the tables' addresses stay theirs while the plan lives
        self.key = _addresses(self.entries)
        self.rest: list[tuple] = []
        groups: dict[tuple, list[tuple]] = {}
        flat = [x for e in self.entries for x in e if x is not None]
        triton_ok = bool(flat) and use_triton(*flat)
        for e in self.entries:
            w, m, v, g, p = e
            n = w.numel()
            ok = (triton_ok and g is not None and n > 0 and w.dtype == m.dtype == v.dtype == torch.float32
                  and m.numel() == v.numel() == g.numel() == p.numel() == n and _aligned(w, m, v, g, p))
            if ok:
                groups.setdefault((g.dtype, p.dtype), []).append(e)
            else:
                self.rest.append(e)
        block = 64 if interpreting() else _MT_BLOCK
        self.tables = [(group[0][3], group[0][4], MultiTensorTable(
            [[w.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), p.data_ptr(), w.numel()]
             for w, m, v, g, p in group], [e[0].numel() for e in group], block, group[0][0].device), block)
            for group in groups.values()]


def master_adamw_multi_(entries: list[tuple], lr, step_size, bc2_sqrt, scale, skip, *, beta1, beta2, eps,
                        weight_decay, plan: AdamwPlan | None = None) -> None:
    """``master_adamw_`` over many parameters: ``entries`` are ``(w, m, v, grad, param)`` (grad may be None), the
    update the same per element. On CUDA (and interpreted) one launch per dtype pair covers every entry with a
    gradient whose tensors are contiguous and 16-byte aligned (``AdamwPlan``; build it ahead of a CUDA graph
    capture), instead of one launch per parameter; the others run one by one."""
    if plan is None or plan.key != _addresses(entries):
        plan = AdamwPlan(entries)  # none ahead, or built for other tensors
    hp = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    for g_ref, p_ref, table, block in plan.tables:
        multi_adamw_kernel[(table.programs,)](table.rows, table.chunk_t, table.first, lr, step_size, bc2_sqrt,
                                               scale, skip, beta1, beta2, eps, weight_decay, g_ref, p_ref,
                                               BLOCK=block, num_warps=8)
    for w, m, v, g, p in plan.rest:
        master_adamw_(w, m, v, g, p, lr, step_size, bc2_sqrt, scale, skip, **hp)
