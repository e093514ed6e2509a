"""``MasterAdamW.step``'s one-rank paths (no DP or TP group, no offload) that update many buckets per launch.

The bucketed step (areno.training.optimizer) walks the buckets one at a time: per ~25 MiB bucket a flat gradient
copy, its norm, the update and the publish, about five launches and ~100 us of Python each, ~575 buckets a step at a
9B-parameter shape: the host, not the GPU, sets the step's time. Alone on one rank it need not:

- fp32 states on CUDA (``fused_fp32``): the step is ``device_step`` (multi-tensor kernels reading the bf16
  gradients where they are: ~30 bytes a parameter moved instead of ~48) plus one read of the norm. ``device_step``
  (``device_norm`` then ``device_update``) is also what the training CUDA graphs capture (areno.training.graphs,
  through ``MasterAdamW.device_step`` and its halves): it never syncs with the host.
- 8-bit states (``Chunk8bit``): consecutive buckets of one learning-rate group and dtype share a chunk of at most
  ``CHUNK_ELEMENTS``: one fp32 master, one [2, n] code array and one [2, n / 256] absmax array, each bucket's slices
  views of them starting on a 256-element block (the padding stays zero: zero gradient, zero moments, zero master),
  so a bucket's blocks, codes and saved state are exactly the bucketed path's. A step takes the global norm from the
  gradients in one multi-tensor launch, then per chunk copies the gradients into one transient buffer (releasing
  them), runs the 8-bit kernel once over the chunk and writes the parameters in one launch. Buckets of fp32
  parameters (their own master: no chunk) are updated one by one from copies of the parameters.

Both consume the gradients as the bucketed step does, skip a step whose norm is not finite, and clip alike (the
gradient divided by ``(norm + 1e-6) / grad_clip``; the norm summed as ``grad_sumsq`` does: fp32 blocks, fp64 total).
``MasterAdamW.fused = False`` keeps the bucketed step (the tests' reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from areno.kernels.adamw import AdamwPlan, SumsqPlan, bias_corrections, grad_sumsq, master_adamw_multi_
from areno.kernels.adamw8bit import QBLOCK, Moments8bit, n_blocks

CHUNK_ELEMENTS = 2**28  # 1 GiB of fp32 master; the step's transient gradient buffer is at most 512 MiB in bf16


def alone(opt) -> bool:
    """One rank, no offload: where these paths apply."""
    return opt.dp_group is None and opt.tp_group is None and opt.offload == "none"


def fused_fp32(opt) -> bool:
    return opt.fused and alone(opt) and opt.states == "fp32" and opt.device.type == "cuda"


def fused_fp32_step(opt, lr: float, grad_clip: float, group_lrs: dict[str, float]) -> float:
    """``step`` through ``device_step`` (one host read: the norm)."""
    scalar = lambda x: torch.tensor(float(x), dtype=torch.float32, device=opt.device)  # noqa: E731
    norm = float(device_step(opt, scalar(lr), grad_clip, scalar(opt.num_steps),
                             group_lrs={k: scalar(v) for k, v in group_lrs.items()}))  # fmt: skip
    opt.zero_grad()
    if math.isfinite(norm):
        opt.num_steps += 1
    return norm


@torch.no_grad()
def device_step(opt, lr: torch.Tensor, grad_clip: float, step: torch.Tensor, *,
                group_lrs: dict[str, torch.Tensor] | None = None, skip: torch.Tensor | None = None,
                plan: dict | None = None) -> torch.Tensor:
    """``step()`` without a host sync, so a CUDA graph can capture it (areno.training.graphs). Single rank
    (no DP/TP group), no offload. ``lr`` and each ``group_lrs`` value are 0-dim fp32 device tensors, ``step``
    the fp32 device step count before this step (incremented here unless skipped), ``skip`` an optional 0-dim
    fp32 tensor (1 skips the update: a dry run). Reads ``p.grad`` (``None`` counts as zero) and leaves it. The
    norm is taken from the gradients themselves (fp32 sums per block, added in fp64: ``grad_sumsq``); the clip
    factor and the skip of a non-finite norm happen on the device: the gradient is divided by ``max(1, (norm +
    1e-6) / grad_clip)`` and a skipped step changes nothing, in one fused pass over the master-bucket
    parameters of each learning-rate group (``areno.kernels.adamw.master_adamw_multi_``: bf16 gradient in,
    master and moments updated, parameter written; one launch for all of them) and through
    torch's fused AdamW (``grad_scale``, ``found_inf``) for fp32 buckets. Returns the fp64 norm tensor; the
    caller adds 1 to ``num_steps`` once it has read a finite one. The master, moments and parameters change in
    place exactly as ``step()`` changes them (up to the rounding of the clip factor). It is ``device_norm``
    then ``device_update``: a caller may read the norm between the two while the update runs. ``plan``:
    ``device_plan()``'s launch tables, built ahead of a CUDA graph capture."""
    norm, bad, scale = device_norm(opt, grad_clip, skip=skip, plan=plan)
    device_update(opt, lr, step, bad, scale, group_lrs=group_lrs, plan=plan)
    return norm


def device_plan(opt) -> dict:
    """The multi-tensor launch tables of ``device_norm`` and ``device_update`` over the current ``p.grad``
    tensors (``areno.kernels.adamw``: one gradient sum-of-squares launch and one master-AdamW launch per
    learning-rate group, instead of one or two per parameter). Built outside a CUDA graph capture and passed
    to both while capturing; whoever replays the graphs holds it (the tables carry the tensors' addresses)."""
    plan = {"norm": SumsqPlan([p.grad for p in opt.params if p.grad is not None])}
    for name, entries in master_entries(opt).items():
        plan[("adamw", name)] = AdamwPlan(entries)
    return plan


def master_entries(opt) -> dict:
    """``(w, m, v, grad, param)`` of every master-bucket parameter, per learning-rate group (None: the main)."""
    out: dict = {}
    for b in opt.buckets:
        if b.has_master:
            w, m, v = b.storage.view(3, b.shard).unbind(0)
            for p, off in zip(b.params, b.offsets):
                sl = slice(off, off + p.numel())
                out.setdefault(b.group, []).append((w[sl], m[sl], v[sl], p.grad, p.detach()))
    return out


@torch.no_grad()
def device_norm(opt, grad_clip: float, *, skip: torch.Tensor | None = None, plan: dict | None = None):
    """The first half of ``device_step``: ``(norm fp64, bad, scale)`` device tensors from the gradients
    (``bad`` 1 skips the update: a non-finite norm or ``skip``; ``scale`` divides the gradient). ``plan``:
    ``device_plan()``'s tables, built ahead (needed under a CUDA graph capture)."""
    if opt.dp_group is not None or opt.tp_group is not None or opt.offload != "none" or opt.states != "fp32":
        raise RuntimeError("MasterAdamW.device_step: one rank, fp32 states, no --optimizer-state-offload only")
    grads = [p.grad for p in opt.params if p.grad is not None]
    sumsq = torch.zeros((), dtype=torch.float64, device=opt.device)
    if grads:
        sumsq = grad_sumsq(grads, None if plan is None else plan["norm"])
    norm = sumsq.sqrt()
    bad = (~torch.isfinite(norm)).float()
    if skip is not None:
        bad = torch.maximum(bad, skip)
    scale = ((norm + 1e-6) / grad_clip).clamp(min=1.0).float() if grad_clip > 0 else torch.ones_like(bad)
    return norm, bad, scale


@torch.no_grad()
def device_update(opt, lr: torch.Tensor, step: torch.Tensor, bad: torch.Tensor, scale: torch.Tensor, *,
                  group_lrs: dict[str, torch.Tensor] | None = None, plan: dict | None = None) -> None:
    """The second half of ``device_step``: the update from ``device_norm``'s ``bad`` and ``scale`` (``plan``:
    as ``device_norm``'s)."""
    missing = [g for g in opt.groups if g not in (group_lrs or {})]
    if missing:
        raise ValueError(f"MasterAdamW.device_step: no learning rate for the parameter groups {missing}")
    step.add_(1.0 - bad)
    beta1, beta2 = opt.betas
    # master buckets: one fused pass over every parameter of a learning-rate group (gradient in, master and
    # moments updated, parameter out; areno.kernels.adamw)
    for name, entries in master_entries(opt).items():
        g_lr = lr if name is None else group_lrs[name]
        master_adamw_multi_(entries, g_lr, *bias_corrections(g_lr, step, beta1, beta2), scale, bad, beta1=beta1,
                            beta2=beta2, eps=opt.eps, weight_decay=opt.weight_decay,
                            plan=None if plan is None else plan[("adamw", name)])
    for b in opt.buckets:
        b_lr = lr if b.group is None else group_lrs[b.group]
        if b.has_master:
            continue
        # one rank: the parameters tile the bucket, so with every gradient present nothing is left to zero
        full = all(p.grad is not None for p in b.params) and b.numel == b.shard
        g = (torch.empty if full else torch.zeros)(b.shard, dtype=torch.float32, device=opt.device)
        pairs = [(g[off : off + p.numel()], p.grad.reshape(-1)) for p, off in zip(b.params, b.offsets)
                 if p.grad is not None]
        if pairs:
            torch._foreach_copy_(*map(list, zip(*pairs)))
        w = opt.read_params(b)
        m, v = b.storage.view(2, b.shard).unbind(0)
        torch._fused_adamw_([w], [g], [m], [v], [], [step], lr=b_lr,
                            beta1=beta1, beta2=beta2, weight_decay=opt.weight_decay, eps=opt.eps,
                            amsgrad=False, maximize=False, grad_scale=scale, found_inf=bad)
        opt.publish(b, w)


@dataclass
class Chunk8bit:
    buckets: list
    starts: list[int]  # each bucket's first element in the chunk (a multiple of QBLOCK)
    size: int  # elements, padding included
    w: torch.Tensor  # fp32 [size]: the buckets' masters
    codes: torch.Tensor  # uint8 [2, size]: exp_avg, exp_avg_sq
    absmax: torch.Tensor  # fp32 [2, size / QBLOCK]

    @property
    def group(self):
        return self.buckets[0].group

    @property
    def dtype(self):
        return self.buckets[0].dtype


def chunk_8bit(buckets, device) -> list[Chunk8bit]:
    """Chunks of the low-precision buckets (in order, one group and dtype each), each bucket's ``storage`` (its
    master) and ``moments8`` made views of its chunk; fp32 buckets are left alone."""
    chunks, run = [], []

    def close():
        if not run:
            return
        starts = [0]
        for b in run:
            starts.append(starts[-1] + n_blocks(b.shard) * QBLOCK)
        size = starts.pop()
        c = Chunk8bit(list(run), starts, size, torch.zeros(size, dtype=torch.float32, device=device),
                      torch.zeros(2, size, dtype=torch.uint8, device=device),
                      torch.zeros(2, size // QBLOCK, dtype=torch.float32, device=device))  # fmt: skip
        for b, s in zip(c.buckets, c.starts):
            b.storage = c.w[s : s + b.shard]
            b.moments8 = Moments8bit.of(c.codes[:, s : s + b.shard],
                                        c.absmax[:, s // QBLOCK : s // QBLOCK + n_blocks(b.shard)])  # fmt: skip
        chunks.append(c)
        run.clear()

    for b in buckets:
        if not b.has_master:
            close()
            continue
        if run and ((b.group, b.dtype) != (run[0].group, run[0].dtype)
                    or sum(n_blocks(x.shard) * QBLOCK for x in run) + b.shard > CHUNK_ELEMENTS):  # fmt: skip
            close()
        run.append(b)
    close()
    return chunks


def chunked_8bit_step(opt, lr: float, grad_clip: float, group_lrs: dict[str, float]) -> float:
    """One ``step`` of an 8-bit ``MasterAdamW`` alone on its rank (see the module docstring); returns the norm."""
    grads = [p.grad for p in opt.params if p.grad is not None]
    norm = float(grad_sumsq(grads).sqrt()) if grads else 0.0
    if not math.isfinite(norm):
        opt.zero_grad()
        return norm
    coef = grad_clip / (norm + 1e-6) if grad_clip > 0 else 1.0
    opt.num_steps += 1
    hp = dict(step=opt.num_steps, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps,
              weight_decay=opt.weight_decay, divisor=1.0 / coef if coef < 1.0 else 1.0)  # fmt: skip
    rate = lambda group: lr if group is None else group_lrs[group]  # noqa: E731
    chunked = set()
    for c in opt.chunks:
        g = torch.empty(c.size, dtype=c.dtype, device=opt.device)
        dst, src, zero, params, masters = [], [], [], [], []
        for b, s in zip(c.buckets, c.starts):
            chunked.add(id(b))
            for p, off in zip(b.params, b.offsets):
                view = g[s + off : s + off + p.numel()]
                (dst.append(view), src.append(p.grad.reshape(-1))) if p.grad is not None else zero.append(view)
                params.append(p.detach().view(-1))
                masters.append(c.w[s + off : s + off + p.numel()])
            zero.append(g[s + b.shard : s + n_blocks(b.shard) * QBLOCK])  # the block padding: zero gradient
        if dst:
            torch._foreach_copy_(dst, src)
        zero = [z for z in zero if z.numel()]
        if zero:
            torch._foreach_zero_(zero)
        for b in c.buckets:
            for p in b.params:
                p.grad = None
        Moments8bit.of(c.codes, c.absmax).step_(c.w, g, lr=rate(c.group), **hp)
        torch._foreach_copy_(params, masters)
        del g
    for b in opt.buckets:  # fp32 parameters: their own master, updated from a copy
        if id(b) in chunked:
            continue
        w = torch.cat([p.detach().reshape(-1) for p in b.params])
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params])
        b.moments8.step_(w, g, lr=rate(b.group), **hp)
        torch._foreach_copy_([p.detach().view(-1) for p in b.params], list(w.split([p.numel() for p in b.params])))
        for p in b.params:
            p.grad = None
    return norm
