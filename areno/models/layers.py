"""The leaf modules of every adapter: linear, vocab embedding, RMSNorm, and the opaque kept checkpoint tensors.

Plain parameters and areno kernels. Each holds ``tp_style``/``tp_group`` (``None`` unless the TP plan in
``tp.py`` set them) and runs the matching collective; without TP they are the plain single-device ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from areno.kernels.fp8 import Fp8Weight, act_alone_applies, fp8_linear, fused_act_applies, quantize_weight_fp8
from areno.kernels.gemm import linear
from areno.kernels.nf4 import Nf4Weight, dequantize_nf4, nf4_linear, quantize_nf4
from areno.kernels.norm import rms_norm, rms_norm_fp8
from areno.models.tp import copy_to_tp, gather_from_tp, layout, reduce_from_tp


def fp8_buffer_names(param: str) -> tuple[str, str]:
    """The buffers that hold parameter ``param``'s FP8 copy (codes, scales): a Linear's ``fp8_qweight`` and
    ``fp8_scale``, stacked experts' ``fp8_w13_qweight``, ``fp8_w13_scale`` and so on."""
    stem = "fp8" if param == "weight" else f"fp8_{param}"
    return f"{stem}_qweight", f"{stem}_scale"


def held_fp8(module: nn.Module, param: str) -> Fp8Weight:
    q, s = fp8_buffer_names(param)
    return Fp8Weight(module._buffers[q], module._buffers[s])


@torch.no_grad()
def hold_fp8_(module: nn.Module, param: str, q: Fp8Weight | None = None, rows: int | None = None) -> None:
    """Hold ``q`` (else ``module.<param>`` quantised blockwise: ``[N, K]``, or ``[E, N, K]`` expert by expert; its
    first ``rows`` rows if given) as the parameter's FP8 copy, in non-persistent buffers; an existing copy of the
    same shape is overwritten in place (captured CUDA graphs keep reading the same memory)."""
    w = getattr(module, param)
    w = w if rows is None else w[:rows]
    q = quantize_weight_fp8(w) if q is None else q
    if tuple(q.shape) != tuple(w.shape):
        raise ValueError(f"an FP8 weight {tuple(q.shape)} for a {tuple(w.shape)} one")
    qname, sname = fp8_buffer_names(param)
    old = module._buffers.get(qname)
    if old is not None and old.shape == q.qweight.shape:
        old.copy_(q.qweight)
        module._buffers[sname].copy_(q.scale)
        return
    module.register_buffer(qname, q.qweight.to(w.device).contiguous(), persistent=False)
    module.register_buffer(sname, q.scale.to(w.device, torch.float32).contiguous(), persistent=False)


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W [out, in]``; column/row parallel when the TP plan says so. ``linear`` is cuBLAS
    except for small inference batches (decode), where a tuned split-K Triton GEMM is faster.

    ``quantize_nf4_()`` (QLoRA's frozen base, never under TP) replaces the weight parameter by its NF4 buffers
    (``nf4_packed``, ``nf4_qabs``, ``nf4_absmax2``, ``nf4_offset``: bitsandbytes' format); the forward then runs the
    NF4 GEMM, and ``weight`` reads as the dequantised tensor (a fresh one each time, for saving and merging).

    ``set_fp8_()`` (FP8 rollout, ``models/fp8_rollout.py``) holds a blockwise E4M3 copy of the weight beside it
    (buffers ``fp8_qweight``, ``fp8_scale``); while ``fp8_on`` the forward runs the FP8 GEMM on that copy (the
    rollout engine's forward), otherwise the weight as usual (the trainer's); under TP the same collectives run
    around either."""

    tp_style: str | None = None
    tp_group = None
    fp8_params = ("weight",)  # what FP8 rollout quantises (models/fp8_rollout.py)
    nf4_shape: tuple | None = None  # set by quantize_nf4_
    nf4_dtype: torch.dtype | None = None
    fp8_on: bool = False  # forward through the FP8 copy (set by fp8_rollout.fp8_forward)
    fp8_kept_parts: int = 0  # trailing parts of the weight's layout FP8 rollout leaves in its dtype (per-head scalars)
    fp8_rows: int | None = None  # the leading rows the FP8 copy covers (None: all; set by fp8_rollout)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = getattr(x, FP8_ACT, None) if self.fp8_on else None  # x's producer quantised it (with_fp8_act)
        if getattr(x, FP8_ONLY, False) and not self.multiplies_act_alone(x):
            raise RuntimeError("an activation carried only as its FP8 quantisation reached a projection that reads its "
                               "values (with_fp8_act(values=False) is for multiplies_act_alone consumers)")
        if self.tp_style == "row":
            y = reduce_from_tp(self._product(x, None, act), self.tp_group)
            return y if self.bias is None else y + self.bias
        if self.tp_style == "column":
            x = copy_to_tp(x, self.tp_group)
        return self._product(x, self.bias, act)

    def multiplies_act_alone(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` of x carrying its FP8 quantisation reads that alone, never x's values: FP8 over the
        whole weight on cuBLAS's path (x's dtype and device as given)."""
        return self.fp8_on and self.fp8_rows is None and act_alone_applies(x, self.fp8())

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None, act=None) -> torch.Tensor:
        """``x W^T + bias`` on this rank's weight: the FP8 copy while ``fp8_on`` (``act``: x already quantised), the
        NF4 one, or the weight."""
        if self.fp8_on:
            r = self.fp8_rows
            if r is None:
                return fp8_linear(x, self.fp8(), bias, act=act)
            head = fp8_linear(x, self.fp8(), None if bias is None else bias[:r], act=act)  # the rest: rows kept
            return torch.cat([head, linear(x, self.weight[r:], None if bias is None else bias[r:])], dim=-1)
        if self.nf4_shape is not None:
            return nf4_linear(x, self.nf4(), bias)
        return linear(x, self.weight, bias)

    def quantize_nf4_(self, q: Nf4Weight | None = None) -> None:
        """Hold the weight as NF4 (``q``, else quantised from the weight) and free the full-precision one."""
        if self.tp_style is not None:
            raise ValueError("NF4 weights under tensor parallelism are not built")
        dtype = self.nf4_dtype or self.weight.dtype
        if q is None:
            q = quantize_nf4(self.weight)
        elif tuple(q.shape) != tuple(self.nf4_shape or self.weight.shape):
            raise ValueError(f"an NF4 weight {tuple(q.shape)} for a {tuple(self.nf4_shape or self.weight.shape)} one")
        if "weight" in self._parameters:
            del self.weight
        for name, t in zip(NF4_BUFFERS, q[:4]):
            self.register_buffer(name, t, persistent=False)
        self.nf4_shape, self.nf4_dtype = tuple(q.shape), dtype

    def set_fp8_(self, q: Fp8Weight | None = None) -> None:
        """Hold ``q`` (else the weight quantised blockwise) as the FP8 copy (``hold_fp8_``); under TP this rank's
        shard (models/fp8_rollout.py keeps the shards on the full weight's block grid); with ``fp8_rows`` of the
        leading rows only."""
        hold_fp8_(self, "weight", q, self.fp8_rows)

    def fp8(self) -> Fp8Weight:
        return held_fp8(self, "weight")

    def nf4(self) -> Nf4Weight:
        return Nf4Weight(*(self._buffers[n] for n in NF4_BUFFERS), self.nf4_shape)

    def weight_shape(self) -> tuple:
        """The weight's ``(out, in)`` (this rank's shard); an NF4 one's without dequantising it."""
        return self.nf4_shape or tuple(self.weight.shape)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "weight" and self.nf4_shape is not None:
                return dequantize_nf4(self.nf4(), self.nf4_dtype)
            raise


NF4_BUFFERS = ("nf4_packed", "nf4_qabs", "nf4_absmax2", "nf4_offset")


class VocabEmbedding(nn.Module):
    """Token embedding ``[V, H]``; vocab parallel under TP (this rank holds rows ``[vocab_start, vocab_end)``)."""

    tp_style: str | None = None
    tp_group = None

    def __init__(self, vocab_size: int, hidden_size: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))
        self.vocab_start, self.vocab_end = 0, vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(inside, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return reduce_from_tp(out, self.tp_group)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """``hidden @ W^T`` over the full vocabulary, ``W`` this rank's vocab shard (logits all-gathered under TP)."""
    return gather_from_tp(F.linear(copy_to_tp(hidden, group), weight), group)


class RMSNorm(nn.Module):
    """``rms_norm`` over the last dim; ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``.

    While ``fp8_act`` (FP8 rollout's forward: ``fp8_rollout.set_active`` marks the hidden-size norms of a model
    whose projections run FP8) the kernel also writes the output quantised for the FP8 GEMMs that read it
    (``rms_norm_fp8``) and the output carries it (``with_fp8_act``): the projection then skips its own activation
    kernel."""

    tp_style: str | None = None
    tp_group = None
    zero_centered = False  # scale by 1 + weight (Qwen3.5's, rms_norm(zero_centered=True))
    fp8_act_source = True  # may feed a projection (fp8_rollout marks it; a norm over a projection's output is not)
    fp8_act = False  # set by fp8_rollout.set_active

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fp8_act and fused_act_applies(x):
            y, h, act = rms_norm_fp8(x, self.weight, self.eps, residual, self.zero_centered)
            y = with_fp8_act(y, act)
            return y if residual is None else (y, h)
        return rms_norm(x, self.weight, self.eps, residual=residual, zero_centered=self.zero_centered)


FP8_ACT = "_areno_fp8_act"  # a tensor's own FP8 quantisation in cuBLAS's layout, written by the kernel that made it
FP8_ONLY = "_areno_fp8_only"  # ... and its own values were never written (only that quantisation is to be read)


def with_fp8_act(y: torch.Tensor, act, values: bool = True) -> torch.Tensor:
    """``y`` carrying ``act`` (``(xq, s)``, ``fp8.cublas_act_buffers``' layout, y's rows quantised): a ``Linear``
    running FP8 multiplies it instead of quantising y again. Only for a tensor nothing modifies in place.
    ``values=False``: y's values were not written (``silu_and_mul_fp8(keep_y=False)``); a Linear that would read them
    (not ``multiplies_act_alone``) refuses it."""
    setattr(y, FP8_ACT, act)
    if not values:
        setattr(y, FP8_ONLY, True)
    return y


class KeptTensors(nn.Module):
    """Checkpoint tensors an adapter holds untouched (Ling 3's MTP layers, Gemma 4's towers): frozen, replicated
    parameters ``t0, t1, ...`` saved back under their Hub names (``names``); 0-d tensors included."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def add(self, hf_name: str, tensor: torch.Tensor) -> str:
        """Hold a copy of ``tensor``; returns its parameter name inside this module."""
        pname = f"t{len(self.names)}"
        self.register_parameter(pname, nn.Parameter(tensor.clone(), requires_grad=False))
        self.names.append(hf_name)
        return pname

    def layouts(self, prefix: str) -> dict:
        """``{f"{prefix}.t{j}": [Layout]}`` of every kept tensor (one part: the whole Hub tensor)."""
        out = {}
        for j, hf_name in enumerate(self.names):
            p = getattr(self, f"t{j}")
            out[f"{prefix}.t{j}"] = [layout(tuple(p.shape), 0, [(hf_name, p.shape[0] if p.dim() else 1)])]
        return out
