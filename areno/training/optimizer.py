"""AdamW with fp32 master weights, bucketed data-parallel gradient reduction, ZeRO-1 state sharding and offload.

The parameters are grouped by dtype and cut, in order, into flat buckets of about ``bucket_bytes`` (fp32 bytes; a
parameter larger than a bucket gets one of its own). Each bucket is padded to a multiple of the data-parallel size
``D`` and split into ``D`` contiguous shards: rank ``r`` owns shard ``r`` of every bucket and keeps its optimizer
state (fp32 master copy, ``exp_avg``, ``exp_avg_sq``). One ``step()``:

1. per bucket: flatten the gradients into an fp32 buffer (``None`` counts as zero) and reduce-scatter it (SUM: the
   loss is already normalised over the whole global batch) so each rank holds its shard of the summed gradient;
2. the global grad norm: squares summed over the shards, then over DP and over TP ranks, where parameters marked
   ``p.tp_replicated = True`` count on TP rank 0 only, so the norm equals the unsharded model's;
3. clip (``grad_clip / (norm + 1e-6)`` when below 1, as ``torch.nn.utils.clip_grad_norm_``) and update each shard
   exactly as ``torch.optim.AdamW`` (decoupled weight decay, bias correction; ``foreach=False`` numerics);
4. round the updated master shard to the parameter dtype, all-gather it over DP and copy it into the parameters
   IN PLACE (the rollout engine and its CUDA graphs hold these storages: ``p.data`` is never replaced).

Parameter groups: ``params`` may list dicts ``{"name": str, "params": [...]}`` beside plain parameters (the
multimodal tower and projector under ``--unfreeze-mm-tower`` / ``--unfreeze-mm-projector``). Buckets never mix
groups; ``step(lr, group_lrs={name: lr})`` updates each named group with its own rate, and clipping uses the one
global norm over every group (as ``torch.optim`` param groups under ``clip_grad_norm_``).

fp32 parameters are their own master (no copy is kept; their shard is read from the parameters for the update).
Offload moves the state off the device between steps: ``"cpu"`` keeps it in host memory (pinned when CUDA is
available), ``"disk"`` in process-private raw ``numpy.memmap`` files (``offload_batch_size`` buckets per file, read
to the device one file at a time, written back and flushed per file, removed by ``close()`` or at interpreter exit;
runtime scratch, never a checkpoint). ``states="8bit"`` (``--optimizer-states 8bit``) keeps each shard's moments
blockwise-quantised to 8 bits (``areno.kernels.adamw8bit``: ~2 bytes per element instead of 8; the fp32 master
stays), saved and restored exactly (codes and absmax); it has no offload and no ``device_step``. A step whose grad
norm is not finite is skipped (no state or weight change).
Alone on one rank (no DP or TP group, no offload) ``step`` updates many buckets a launch (``optimizer_fused``: fp32
states through ``device_step`` on CUDA, 8-bit states in chunks of buckets); ``fused = False`` keeps the bucketed step.
``device_step`` is the same update without a host sync (norm, clip factor and skip on the device) for CUDA-graph
capture of a single-rank step; a step it skips writes the unchanged master back (the parameters are its rounding).
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from areno.config.constants import OFFLOAD_MODES, OPTIMIZER_STATES
from areno.distributed.collectives import group_rank, group_size
from areno.kernels.adamw8bit import Moments8bit
from areno.training.optimizer_fused import (
    alone,
    chunk_8bit,
    chunked_8bit_step,
    device_norm,
    device_plan,
    device_step,
    device_update,
    fused_fp32,
    fused_fp32_step,
)

_OFFLOAD_DIRS: set[str] = set()  # disk-offload folders of this process, removed at exit


@atexit.register
def _remove_offload_dirs() -> None:
    for d in list(_OFFLOAD_DIRS):
        shutil.rmtree(d, ignore_errors=True)
        _OFFLOAD_DIRS.discard(d)


def _reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group) -> None:
    if dist.get_backend(group) == "gloo":  # older gloo builds lack reduce_scatter: all-reduce and keep the shard
        dist.all_reduce(flat, group=group)
        out.copy_(flat[group_rank(group) * out.numel() : (group_rank(group) + 1) * out.numel()])
    else:
        dist.reduce_scatter_tensor(out, flat, group=group)


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    if dist.get_backend(group) == "gloo":
        dist.all_gather(list(out.chunk(group_size(group))), shard, group=group)
    else:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, shard, group=group)


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]  # start of each parameter in the flat bucket
    numel: int  # real elements; the bucket is padded to ``shard * D``
    shard: int  # elements per rank
    dtype: torch.dtype
    group: str | None = None  # a named parameter group (its own learning rate); None: the main group
    counted: list[tuple[int, int]] = field(default_factory=list)  # shard-local ranges counted in the grad norm
    storage: torch.Tensor | None = None  # [k * shard] fp32: (master,) exp_avg, exp_avg_sq; None for disk offload
    moments8: Moments8bit | None = None  # --optimizer-states 8bit: the moments (storage then holds the master only)
    file: int = -1  # disk offload: file index and element offset in it
    file_offset: int = 0

    @property
    def has_master(self) -> bool:
        return self.dtype != torch.float32

    @property
    def state_numel(self) -> int:
        """fp32 elements of ``storage``: the master (for a low-precision dtype) and, without ``moments8``, the
        moments."""
        return (int(self.has_master) + (0 if self.moments8 is not None else 2)) * self.shard

    def moments(self, s: torch.Tensor):
        """The fp32 ``exp_avg``, ``exp_avg_sq`` views of the state ``s`` (the moments of the fp32 states)."""
        return s[self.shard if self.has_master else 0 :].view(2, self.shard).unbind(0)


def _make_buckets(params, group_of: dict, bucket_bytes: int, dp_size: int, dp_rank: int,
                  tp_rank: int) -> list[_Bucket]:
    """``params`` cut, per (named group, dtype) in order, into buckets of about ``bucket_bytes`` fp32 bytes, each
    padded to ``dp_size`` shards, with the shard-local ranges rank ``dp_rank`` counts in the grad norm."""
    by_dtype: dict[tuple, list] = {}
    for p in params:
        by_dtype.setdefault((group_of.get(id(p)), p.dtype), []).append(p)
    cap = max(1, bucket_bytes // 4)
    buckets = []
    for (name, dtype), group in by_dtype.items():
        cur: list = []
        for p in group + [None]:
            full = cur and (p is None or sum(q.numel() for q in cur) + p.numel() > cap)
            if full:
                offsets = np.cumsum([0] + [q.numel() for q in cur])
                n = int(offsets[-1])
                buckets.append(_Bucket(cur, [int(o) for o in offsets[:-1]], n, -(-n // dp_size), dtype, name))
                cur = []
            if p is not None:
                cur.append(p)
    for b in buckets:  # shard-local ranges of the parameters this rank counts in the grad norm
        lo = dp_rank * b.shard
        for p, off in zip(b.params, b.offsets):
            if getattr(p, "tp_replicated", False) and tp_rank != 0:
                continue
            a, e = max(off, lo) - lo, min(off + p.numel(), lo + b.shard) - lo
            if a < e:
                if b.counted and b.counted[-1][1] == a:
                    b.counted[-1] = (b.counted[-1][0], e)
                else:
                    b.counted.append((a, e))
    return buckets


class MasterAdamW:
    def __init__(self, params, *, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, dp_group=None,
                 tp_group=None, offload="none", offload_dir=None, offload_batch_size=1, bucket_bytes=25 * 2**20,
                 states="fp32"):
        self.group_of: dict[int, str] = {}  # id(param) -> its named group
        flat = []
        for item in params:
            if isinstance(item, dict):
                for p in item["params"]:
                    self.group_of[id(p)] = item["name"]
                    flat.append(p)
            else:
                flat.append(item)
        params = flat
        self.groups = sorted(set(self.group_of.values()))
        if not params:
            raise ValueError("MasterAdamW: no parameters to optimize")
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"--optimizer-state-offload must be none, cpu or disk, not {offload!r}")
        if offload == "disk" and offload_dir is None:
            raise ValueError("--optimizer-state-offload disk needs --optimizer-state-offload-dir")
        if states not in OPTIMIZER_STATES or (states == "8bit" and offload != "none"):
            raise ValueError(f"--optimizer-states {states!r}: fp32, or 8bit without --optimizer-state-offload")
        self.states = states
        if offload_batch_size < 1:
            raise ValueError(f"--optimizer-state-offload-batch-size must be >= 1, not {offload_batch_size}")
        self.device = params[0].device
        for p in params:
            if p.device != self.device or not p.is_contiguous() or not p.is_floating_point():
                raise ValueError("MasterAdamW: parameters must be contiguous floating tensors on one device")
        self.params = params
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.dp_group = dp_group if group_size(dp_group) > 1 else None
        self.tp_group = tp_group if group_size(tp_group) > 1 else None
        self.dp_size, self.dp_rank = group_size(self.dp_group), group_rank(self.dp_group)
        self.offload, self.offload_batch_size = offload, offload_batch_size
        self.num_steps = 0
        self.fused = True  # one rank: step() updates many buckets a launch (areno.training.optimizer_fused)
        self.chunks: list = []  # one rank, 8-bit states: the buckets' chunks (optimizer_fused.Chunk8bit)
        self._step_tensor: tuple[float, torch.Tensor] | None = None  # (step, its device tensor) for fused AdamW
        self.buckets = _make_buckets(params, self.group_of, bucket_bytes, self.dp_size, self.dp_rank,
                                     group_rank(self.tp_group))
        self.offload_path: Path | None = None
        self._files: list[np.memmap] = []
        self._init_state(offload_dir)

    # ---- layout --------------------------------------------------------------------------------------------
    def read_params(self, b: _Bucket) -> torch.Tensor:
        """This rank's shard of the bucket's parameters as fp32 (zeros in the padding)."""
        lo, hi = self.dp_rank * b.shard, (self.dp_rank + 1) * b.shard
        out = torch.zeros(b.shard, dtype=torch.float32, device=self.device)
        for p, off in zip(b.params, b.offsets):
            a, e = max(off, lo), min(off + p.numel(), hi)
            if a < e:
                out[a - lo : e - lo].copy_(p.detach().view(-1)[a - off : e - off])
        return out

    def _init_state(self, offload_dir) -> None:
        if self.offload == "disk":
            root = Path(offload_dir).expanduser()
            root.mkdir(parents=True, exist_ok=True)
            self.offload_path = root / f"areno-optim-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.mkdir(self.offload_path, 0o700)
            os.chmod(self.offload_path, 0o700)
            _OFFLOAD_DIRS.add(str(self.offload_path))
            k = self.offload_batch_size
            for f, start in enumerate(range(0, len(self.buckets), k)):
                group = self.buckets[start : start + k]
                off = 0
                for b in group:
                    b.file, b.file_offset = f, off
                    off += b.state_numel
                path = self.offload_path / f"state-{f:05d}.bin"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, off * 4)  # a sparse file of zeros
                os.close(fd)
                mm = np.memmap(path, dtype=np.float32, mode="r+", shape=(off,))
                for b in group:
                    if b.has_master:
                        torch.from_numpy(mm[b.file_offset : b.file_offset + b.shard]).copy_(self.read_params(b))
                mm.flush()
                self._files.append(mm)
            return
        pin = self.offload == "cpu" and torch.cuda.is_available()
        where = "cpu" if self.offload == "cpu" else self.device
        if self.states == "8bit" and alone(self):
            self.chunks = chunk_8bit(self.buckets, self.device)  # the low-precision buckets' storage and moments
        for b in self.buckets:
            if b.storage is None:
                b.moments8 = Moments8bit(b.shard, where) if self.states == "8bit" else None
                b.storage = torch.zeros(b.state_numel, dtype=torch.float32, device=where, pin_memory=pin)
            if b.has_master:
                b.storage[: b.shard].copy_(self.read_params(b))

    def _host_view(self, b: _Bucket) -> torch.Tensor:
        """The bucket's state where it lives between steps (device, host, or a view of its mmap file)."""
        if b.storage is not None:
            return b.storage
        return torch.from_numpy(self._files[b.file][b.file_offset : b.file_offset + b.state_numel])

    def _state_groups(self):
        """Yield ``(buckets, device_state)`` one group at a time (a file for disk offload, else a bucket), then
        write the group's state back to its host copy (and flush its file)."""
        if self.offload == "disk":
            for f, mm in enumerate(self._files):
                host = torch.from_numpy(mm)
                dev = host.to(self.device, copy=True)
                yield [b for b in self.buckets if b.file == f], dev
                host.copy_(dev)
                mm.flush()
            return
        for b in self.buckets:
            dev = b.storage.to(self.device, non_blocking=True)  # the storage itself when not offloaded
            yield [b], dev
            if dev is not b.storage:
                b.storage.copy_(dev, non_blocking=True)

    # ---- the step ------------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _grad_shard(self, b: _Bucket) -> torch.Tensor:
        """The bucket's gradient, flattened (one fused copy; ``None`` counts as zero), and the parameters' own
        ``.grad`` released: the step consumes them. Alone: the whole bucket in the parameter dtype. Under DP:
        this rank's shard of the sum over ranks, reduced in fp32."""
        dtype = b.dtype if self.dp_group is None else torch.float32
        flat = torch.zeros(b.shard * self.dp_size, dtype=dtype, device=self.device)
        dst, src = [], []
        for p, off in zip(b.params, b.offsets):
            if p.grad is not None:
                dst.append(flat[off : off + p.numel()])
                src.append(p.grad.reshape(-1))
        if dst:
            torch._foreach_copy_(dst, src)
        for p in b.params:
            p.grad = None
        if self.dp_group is None:
            return flat
        out = torch.empty(b.shard, dtype=torch.float32, device=self.device)
        _reduce_scatter(out, flat, self.dp_group)
        return out

    @torch.no_grad()
    def step(self, lr: float | None = None, grad_clip: float = 0.0, group_lrs: dict[str, float] | None = None) -> float:
        """Reduce gradients, clip to ``grad_clip`` (0 disables), update; returns the global grad norm before
        clipping. Named groups update at ``group_lrs[name]`` (each must be given), the rest at ``lr``. The
        parameters' ``.grad`` are consumed (set to ``None``)."""
        lr = self.lr if lr is None else lr
        missing = [g for g in self.groups if g not in (group_lrs or {})]
        if missing:
            raise ValueError(f"MasterAdamW.step: no learning rate for the parameter groups {missing}")
        if fused_fp32(self):  # one rank: many buckets a launch (optimizer_fused)
            return fused_fp32_step(self, lr, grad_clip, group_lrs or {})
        if self.chunks and self.fused:
            return chunked_8bit_step(self, lr, grad_clip, group_lrs or {})
        shards = [self._grad_shard(b) for b in self.buckets]
        parts = [g[a:e] for b, g in zip(self.buckets, shards) for a, e in b.counted]
        sumsq = torch.zeros((), dtype=torch.float64, device=self.device)
        if parts:
            norms = torch.stack([torch.linalg.vector_norm(x, dtype=torch.float32) for x in parts])
            sumsq = norms.double().square().sum()
        for group in (self.dp_group, self.tp_group):
            if group is not None:
                dist.all_reduce(sumsq, group=group)
        norm = float(sumsq.sqrt())
        if not math.isfinite(norm):
            return norm
        coef = grad_clip / (norm + 1e-6) if grad_clip > 0 else 1.0
        self.num_steps += 1
        index = {id(b): i for i, b in enumerate(self.buckets)}
        for group, dev in self._state_groups():
            for b in group:
                start = b.file_offset if self.offload == "disk" else 0
                s = dev[start : start + b.state_numel]
                w = s[: b.shard] if b.has_master else self.read_params(b)
                b_lr = lr if b.group is None else group_lrs[b.group]
                shard = shards[index[id(b)]]
                if b.moments8 is not None and shard.device == w.device:  # the kernel reads the gradient as it is
                    b.moments8.step_(w, shard, lr=b_lr, step=self.num_steps, beta1=self.betas[0], beta2=self.betas[1],
                                     eps=self.eps, weight_decay=self.weight_decay,
                                     divisor=1.0 / coef if coef < 1.0 else 1.0)
                else:
                    g = shard.float()  # a copy for bf16 buckets, the shard itself otherwise
                    if coef < 1.0:
                        g.mul_(coef)
                    if b.moments8 is not None:
                        b.moments8.step_(w, g, lr=b_lr, step=self.num_steps, beta1=self.betas[0],
                                         beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay)
                    else:
                        self._adamw(w, g, *b.moments(s), b_lr)
                self.publish(b, w)
                shards[index[id(b)]] = None
        if self.offload == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned host copies must be complete before anyone reads them
        return norm

    # ---- the step without host syncs (one rank, fp32 states: CUDA graphs; optimizer_fused has the code) -------
    def device_step(self, lr: torch.Tensor, grad_clip: float, step: torch.Tensor, *,
                    group_lrs: dict[str, torch.Tensor] | None = None, skip: torch.Tensor | None = None,
                    plan: dict | None = None) -> torch.Tensor:
        """``step()`` without a host sync, so a CUDA graph can capture it: ``device_norm`` then ``device_update``
        (``optimizer_fused.device_step``). Returns the fp64 norm tensor."""
        return device_step(self, lr, grad_clip, step, group_lrs=group_lrs, skip=skip, plan=plan)

    def device_plan(self) -> dict:
        """The multi-tensor launch tables of ``device_norm`` and ``device_update`` (``optimizer_fused``)."""
        return device_plan(self)

    def device_norm(self, grad_clip: float, *, skip: torch.Tensor | None = None, plan: dict | None = None):
        """``(norm fp64, bad, scale)`` device tensors from the gradients (``optimizer_fused.device_norm``)."""
        return device_norm(self, grad_clip, skip=skip, plan=plan)

    def device_update(self, lr: torch.Tensor, step: torch.Tensor, bad: torch.Tensor, scale: torch.Tensor, *,
                      group_lrs: dict[str, torch.Tensor] | None = None, plan: dict | None = None) -> None:
        """The update from ``device_norm``'s ``bad`` and ``scale`` (``optimizer_fused.device_update``)."""
        device_update(self, lr, step, bad, scale, group_lrs=group_lrs, plan=plan)

    def _adamw(self, w, g, m, v, lr, fused=None) -> None:
        """torch.optim.AdamW's update: on CUDA its fused kernel (one pass over w, g, m, v instead of ~9), elsewhere
        the single-tensor path op for op."""
        beta1, beta2 = self.betas
        step = float(self.num_steps)
        if fused if fused is not None else (w.is_cuda and hasattr(torch, "_fused_adamw_")):
            cached = self._step_tensor  # one per step, shared by the buckets
            if cached is None or cached[0] != step or cached[1].device != w.device:
                self._step_tensor = cached = (step, torch.tensor(step, dtype=torch.float32, device=w.device))
            torch._fused_adamw_([w], [g], [m], [v], [], [cached[1]], lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=self.weight_decay, eps=self.eps, amsgrad=False, maximize=False)
            return
        if self.weight_decay != 0:
            w.mul_(1 - lr * self.weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(self.eps)
        w.addcdiv_(m, denom, value=-step_size)

    def publish(self, b: _Bucket, w: torch.Tensor) -> None:
        """Round the master shard to the parameter dtype, gather the bucket over DP and write it in place. One rank
        with the master on the parameters' device: each parameter is rounded straight from its master slice (no
        rounded copy of the bucket in between); an offloaded master is rounded first (half the bytes to move)."""
        if self.dp_group is not None:
            full = torch.empty(b.shard * self.dp_size, dtype=b.dtype, device=self.device)
            _all_gather(full, w.to(b.dtype), self.dp_group)
        elif w.device == b.params[0].device:
            full = w
        else:
            full = w.to(b.dtype)
        torch._foreach_copy_([p.detach().view(-1) for p in b.params],
                             [full[off : off + p.numel()] for p, off in zip(b.params, b.offsets)])

    # ---- state ---------------------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"dp_size": self.dp_size, "dp_rank": self.dp_rank,
                "buckets": [[b.numel, str(b.dtype).removeprefix("torch.")] + ([b.group] if b.group else [])
                            for b in self.buckets]} | ({"states": self.states} if self.states != "fp32" else {})

    def state_dict(self) -> dict:
        """This rank's state: step count, layout and per-bucket fp32 shards (``master``, ``exp_avg``,
        ``exp_avg_sq``; with 8-bit states the moments are uint8 codes, with ``exp_avg_absmax`` and
        ``exp_avg_sq_absmax`` beside them, and the layout says ``"states": "8bit"``). Offloaded state is returned
        as host tensors that alias the live state (as with ``torch.optim``): save or clone them before the next
        step."""
        if self.offload == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
        out: dict = {"master": [], "exp_avg": [], "exp_avg_sq": []}
        for b in self.buckets:
            s = self._host_view(b)
            # fp32 params are their own master: a host copy of this shard
            out["master"].append(s[: b.shard] if b.has_master else self.read_params(b).cpu())
            moments = b.moments8.state() if b.moments8 else dict(zip(("exp_avg", "exp_avg_sq"), b.moments(s)))
            for key, t in moments.items():
                out.setdefault(key, []).append(t)
        return {"step": self.num_steps, "layout": self._layout(), **out,
                "hparams": {"betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Restore the state saved by ``state_dict()`` on the same rank of the same layout, and write the master
        weights back into the parameters (a collective over the DP group)."""
        saved = sd["layout"].get("states", "fp32")
        if saved != self.states:
            raise ValueError(f"optimizer state does not fit: saved with --optimizer-states {saved}, this run has "
                             f"{self.states}; resume with the same --optimizer-states")
        if sd["layout"] != self._layout():
            raise ValueError(
                f"optimizer state does not fit: saved layout {sd['layout']['dp_size']} DP ranks / "
                f"{len(sd['layout']['buckets'])} buckets (rank {sd['layout']['dp_rank']}), this optimizer has "
                f"{self.dp_size} / {len(self.buckets)} (rank {self.dp_rank}); resume with the same world size, "
                "--tp-size, parameters and bucket size")
        self.num_steps = int(sd["step"])
        for i, b in enumerate(self.buckets):
            s = self._host_view(b)
            parts = [sd["master"][i]] if b.has_master else []
            if b.moments8 is not None:
                b.moments8.load_({k: sd[k][i] for k in b.moments8.state()})
            else:
                parts += [sd["exp_avg"][i], sd["exp_avg_sq"][i]]
            if parts:
                s.copy_(torch.cat([t.reshape(-1).to(s.device, torch.float32) for t in parts]))
            self.publish(b, sd["master"][i].to(self.device, torch.float32))
        for mm in self._files:
            mm.flush()

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state: fp32 master copies, moments (fp32, or 8-bit codes and absmax)."""
        return sum(4 * b.state_numel + (b.moments8.nbytes if b.moments8 else 0) for b in self.buckets)

    def close(self) -> None:
        """Remove the disk-offload files (the optimizer cannot step afterwards)."""
        self._files = []
        if self.offload_path is not None:
            shutil.rmtree(self.offload_path, ignore_errors=True)
            _OFFLOAD_DIRS.discard(str(self.offload_path))
            self.offload_path = None
