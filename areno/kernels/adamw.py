"""One pass of AdamW over a parameter's fp32 master slice, reading its low-precision gradient and writing the
low-precision parameter: the update of ``MasterAdamW.device_step`` (``areno/rl/optimizer.py``).

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels.dispatch import interpreting, use_triton

_BLOCK = 2048


@triton.jit
def _master_adamw_kernel(
    W, M, V, G, P, n, LR, STEP_SIZE, BC2_SQRT, SCALE, SKIP, beta1, beta2, eps, weight_decay,
    HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if tl.load(SKIP) == 0.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(W + offs, mask=mask, other=0.0)
        m = tl.load(M + offs, mask=mask, other=0.0)
        v = tl.load(V + offs, mask=mask, other=0.0)
        if HAS_GRAD:
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(SCALE)
        else:
            g = tl.zeros([BLOCK], dtype=tl.float32)
        w = w * (1.0 - tl.load(LR) * weight_decay)
        m = m + (g - m) * (1.0 - beta1)
        v = v * beta2 + (1.0 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), tl.load(BC2_SQRT)) + eps  # IEEE-rounded, as torch's ops
        w = w - tl.load(STEP_SIZE) * tl.div_rn(m, denom)
        tl.store(W + offs, w, mask=mask)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
        tl.store(P + offs, w.to(P.dtype.element_ty), mask=mask)


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
    _master_adamw_kernel[(triton.cdiv(n, block),)](
        w, m, v, grad if grad is not None else w, param, n, lr, step_size, bc2_sqrt, scale, skip,
        beta1, beta2, eps, weight_decay, HAS_GRAD=grad is not None, BLOCK=block, num_warps=8,
    )  # fmt: skip
