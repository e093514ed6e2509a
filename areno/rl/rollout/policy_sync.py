"""Policy streaming for split mode: the trainer's weights reach the rollout engines over torch.distributed (NCCL on
GPUs, gloo on CPU), never through a file.

The unit is the Hugging Face (canonical) tensor, so train TP and rollout TP may differ either way: every train rank
walks ``iter_hf_tensors`` (which assembles the train-TP shards), the publishers (the first rank of each train DP
replica, taking buckets in turn) pack whole tensors into byte buckets of ``--policy-sync-bucket-mb`` and broadcast
each to the rollout ranks, and every rollout rank copies its own rollout-TP slice of each tensor in place into the
engine's parameters (no per-tensor allocation; the engine's CUDA graphs keep pointing at the same memory). The
bucket plan (names, shapes, dtypes, byte offsets) goes to the rollout ranks once, with the first sync.

Frozen parameters (``requires_grad=False``: a multimodal tower or projector left frozen, Ling's MTP layers) never
change, so the plan leaves them out; the engines hold them from the checkpoint. Those marked ``streamed`` (the MTP
layers under ``--mtp-loss-weight``, trained outside the policy's optimizer) are streamed with the trainable ones.
After a resume the first sync streams every tensor once (``publish(full=True)``, the full plan), since the resumed
weights may differ there.

A LoRA run (models/lora.py) streams only its adapter: the rollout ranks load the same base and attach the same
adapter, and the plan holds the adapter's tensors under their PEFT names (whole, sharded like the base on either
side: the adapter has TP layouts of its own); the full plan is the base's tensors and the adapter's.

With --rollout-dtype fp8 the quantised modules' weights travel as their FP8 copies instead (``fp8`` here;
``models/fp8_rollout.py`` holds the entries' format): the publisher quantises, the rollout ranks copy the bytes into
their copies, the verified sync compares the copies byte for byte.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areno.models import fp8_rollout
from areno.models.lora import adapter_of
from areno.models.saver import iter_hf_tensors
from areno.models.tp import pieces

ALIGN = 16  # byte offset alignment of every tensor inside a bucket (any dtype view is aligned)


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple
    dtype: str
    offset: int  # bytes from the bucket start
    nbytes: int


def hf_specs(model, *, trainable_only: bool = False) -> list[tuple[str, tuple, torch.dtype]]:
    """``(hf_name, full shape, dtype)`` of every Hugging Face tensor in ``iter_hf_tensors`` order (no communication);
    ``trainable_only``: of the parameters that require gradients."""
    params = dict(model.named_parameters())
    specs, seen = [], set()
    for pname, lays in model._tp_layouts.items():
        if trainable_only and not (params[pname].requires_grad or getattr(params[pname], "streamed", False)):
            continue
        for rank in range(model.tp_size):
            for pc in pieces(lays, rank, model.tp_size):
                if pc.hf_name not in seen:
                    seen.add(pc.hf_name)
                    specs.append((pc.hf_name, tuple(pc.hf_shape), params[pname].dtype))
    return specs


def sync_specs(model, full: bool, fp8: bool = False) -> list[tuple[str, tuple, torch.dtype]]:
    """What a sync streams: ``full``, every tensor; else the trainable ones, or a LoRA run's adapter alone;
    ``fp8``: the quantised modules' FP8 entries in place of their weights."""
    adapter = adapter_of(model)
    if adapter is None:
        specs = hf_specs(model, trainable_only=not full)
        if fp8:
            drop = fp8_rollout.wire_hf_names(model)
            specs = [s for s in specs if s[0] not in drop] + fp8_rollout.wire_specs(model, trainable_only=not full)
        return specs
    return (hf_specs(model) if full else []) + hf_specs(adapter)


def plan_buckets(specs, bucket_bytes: int) -> list[list[Entry]]:
    """Consecutive tensors packed into buckets of at most ``bucket_bytes`` (a larger tensor gets one of its own)."""
    buckets, current, used = [], [], 0
    for name, shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = -(-used // ALIGN) * ALIGN
        if current and start + nbytes > bucket_bytes:
            buckets.append(current)
            current, start = [], 0
        current.append(Entry(name, tuple(shape), str(dtype).removeprefix("torch."), start, nbytes))
        used = start + nbytes
    if current:
        buckets.append(current)
    return buckets


def bucket_size(bucket: list[Entry]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes


def pack(buffer: torch.Tensor, entry: Entry, tensor: torch.Tensor) -> None:
    """Write ``tensor``'s bytes at ``entry`` in the uint8 ``buffer``."""
    buffer[entry.offset : entry.offset + entry.nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))


def unpack(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """A view of ``entry``'s tensor inside ``buffer`` (no copy)."""
    return buffer[entry.offset : entry.offset + entry.nbytes].view(getattr(torch, entry.dtype)).view(entry.shape)


def _tensors(owner):
    """``(hf_name, tensor)`` of a model's (or an adapter's) own tensors: without TP a tensor held whole by one piece
    of a parameter is a view of that slice (packed with one copy), one a parameter holds in several pieces (Qwen3.5's
    fused ``in_proj_qkv``, cut per head group for TP) is assembled; with TP, ``iter_hf_tensors`` assembles the shards
    (a collective over the TP group)."""
    if owner.tp_size > 1:
        yield from iter_hf_tensors(owner)
        return
    params = dict(owner.named_parameters())
    for pname, lays in owner._tp_layouts.items():
        parts: dict[str, list] = {}
        for pc in pieces(lays, 0, 1):
            parts.setdefault(pc.hf_name, []).append(pc)
        p = params[pname].detach()
        for name, pcs in parts.items():
            if len(pcs) == 1:
                yield name, p[pcs[0].dst]
                continue
            full = torch.empty(pcs[0].hf_shape, dtype=p.dtype, device=p.device)
            for pc in pcs:
                full[pc.src] = p[pc.dst]
            yield name, full


def policy_tensors(model, full: bool = True):
    """``(hf_name, tensor)`` of the whole policy, a LoRA adapter's last; a LoRA run's adapter alone unless ``full``
    (the base does not change)."""
    adapter = adapter_of(model)
    if adapter is None or full:
        yield from _tensors(model)
    if adapter is not None:
        yield from _tensors(adapter)


def synced_tensors(model, fp8: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor a sync may stream, whole, on the CPU (the verification's; a collective under TP); ``fp8``: the
    FP8 entries (as bytes) in place of the quantised modules' weights: the copies a rollout rank holds, else
    quantised here from the weights."""
    adapter = adapter_of(model)
    owners = [model] if adapter is None else [model, adapter]
    out = {k: v.cpu() for owner in owners for k, v in iter_hf_tensors(owner)}
    if fp8:
        for name in fp8_rollout.wire_hf_names(model):
            out.pop(name, None)
        held = fp8_rollout.is_fp8(model)
        entries = fp8_rollout.held_wire_tensors(model) if held else fp8_rollout.wire_tensors(model)
        out.update((k, v.cpu().view(torch.uint8)) for k, v in entries)
    return out


class PolicyPublisher:
    """The train side: every train rank calls ``publish`` (it takes part in the train-TP gathers)."""

    def __init__(self, model, layout, bucket_bytes: int, fp8: bool = False):
        self.model, self.layout, self.fp8 = model, layout, fp8
        self.plans = {}  # full -> (plan, owners, where, bytes): every tensor, or only the trainable ones
        for full in (False, True):
            plan = plan_buckets(sync_specs(model, full, fp8), bucket_bytes)
            owner = [layout.publishers[b % len(layout.publishers)] for b in range(len(plan))]
            where = {e.name: (b, e) for b, bucket in enumerate(plan) for e in bucket}
            self.plans[full] = (plan, owner, where, sum(bucket_size(b) for b in plan))
        self.plan, self.owner, self.where, self.nbytes = self.plans[False]
        self._buffer = None

    def publish(self, full: bool = False) -> tuple[int, float]:
        """Stream the current weights (``full``: the frozen ones too); returns (bytes sent, seconds)."""
        t0 = time.perf_counter()
        rank = dist.get_rank()
        plan, owner, where, nbytes = self.plans[full]
        if rank in self.layout.publishers and (self._buffer is None or self._buffer.numel() < max(
                (bucket_size(b) for b in plan), default=0)):  # fmt: skip
            device = next(self.model.parameters()).device
            self._buffer = torch.empty(max(bucket_size(b) for b in plan), dtype=torch.uint8, device=device)
        filled = [0] * len(plan)
        tensors = policy_tensors(self.model, full)
        if self.fp8:
            tensors = itertools.chain(tensors, fp8_rollout.wire_tensors(self.model))
        for name, tensor in tensors:  # every rank walks them all (TP gathers inside)
            b, entry = where.get(name, (None, None))
            if b is None or owner[b] != rank:
                continue
            pack(self._buffer, entry, tensor)
            filled[b] += 1
            if filled[b] == len(plan[b]):
                dist.broadcast(self._buffer[: bucket_size(plan[b])], src=rank, group=self.layout.publish[rank])
        if self._buffer is not None and self._buffer.is_cuda:
            torch.cuda.synchronize()
        return nbytes, time.perf_counter() - t0


class PolicyReceiver:
    """The rollout side: receives every bucket and copies this rank's slice of each tensor into the model."""

    def __init__(self, model, layout):
        self.model, self.layout = model, layout
        self.targets: dict[str, list] = {}
        adapter = adapter_of(model)
        for owner in [model] if adapter is None else [model, adapter]:
            params = dict(owner.named_parameters())
            for pname, lays in owner._tp_layouts.items():
                for pc in pieces(lays, owner.tp_rank, owner.tp_size):
                    self.targets.setdefault(pc.hf_name, []).append((params[pname], pc.dst, pc.src))
        self.fp8 = fp8_rollout.fp8_modules(model) if fp8_rollout.is_fp8(model) else {}
        self.plan = self.owner = None
        self._buffer = None

    @torch.no_grad()
    def receive(self, plan=None, owner=None) -> None:
        if plan is not None:
            self.plan, self.owner = plan, owner
            device = next(self.model.parameters()).device
            size = max(bucket_size(b) for b in plan)
            if self._buffer is None or self._buffer.numel() < size:
                self._buffer = torch.empty(size, dtype=torch.uint8, device=device)
        for bucket, src in zip(self.plan, self.owner):
            view = self._buffer[: bucket_size(bucket)]
            dist.broadcast(view, src=src, group=self.layout.publish[src])
            for entry in bucket:
                full = unpack(view, entry)
                if entry.name.startswith(fp8_rollout.PREFIX):
                    fp8_rollout.receive(self.model, self.fp8, entry.name, full)
                for param, dst, index in self.targets.get(entry.name, ()):
                    param[dst].copy_(full[index])
        self.model.after_weight_update()  # whatever the engine derives from the weights
