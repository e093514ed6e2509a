"""QLoRA's quantised base: the language model's linear projections held as NF4 (``Linear.quantize_nf4_``).

Which layers: every projection LoRA's ``all-linear`` can adapt (``lora.linear_sites``: the language model's linear
layers but ``lm_head`` and the MoE routers; embeddings, norms and ``lm_head`` keep ``--dtype``), as QLoRA does,
whatever ``--lora-target-modules`` names. The full-precision weights are freed; the same modules serve training, the
colocated rollout and the reference (the adapter off). Not built yet, refused in one line: tensor parallelism, MoE
experts (the fused expert kernels read bf16 stacks), MLA (its decode kernel absorbs ``kv_b_proj``'s weight).

When: as the model loads (``load_model(..., quantize_base="nf4")``: one projection's full-precision weight on the
device at a time, never the whole base; ``lora.attach`` then hooks the adapter onto the NF4 modules), or on a loaded
model (``quantize_base``: after a warm-up that trains the base); the same bytes either way.

Files: ``nf4_state`` / ``load_nf4_state`` give the quantised tensors by module name (a checkpoint whose base the
run's warm-up trained holds them, so resume gets the same bytes back); ``dequantized`` lends each quantised module
its dequantised weight as a parameter for the length of a block (saving, merging).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from areno.kernels.nf4 import Nf4Weight
from areno.models.layers import NF4_BUFFERS, Linear
from areno.models.lora import LoraError, linear_sites


def quantizable(model, field: str = "--quantize-base") -> list[str]:
    """The names of the ``Linear`` modules NF4 holds; what is not built yet is refused (``LoraError``)."""
    family = model.config.model_type
    if getattr(model, "tp_size", 1) > 1:
        raise LoraError(field, "nf4 with --tp-size > 1 is not built yet (NF4 weights sharded with their layers)")
    if getattr(model, "num_moe_layers", 0):
        raise LoraError(field, f"nf4 on the MoE model {family} is not built yet (its fused expert kernels read "
                               "bf16 expert stacks)")
    sites = linear_sites(model)
    if any(s.hf_module.endswith("kv_b_proj") for s in sites):
        raise LoraError(field, f"nf4 on the MLA model {family} is not built yet (its decode kernel absorbs "
                               "kv_b_proj's weight)")
    return sorted({s.module for s in sites})


def quantize_base(model) -> tuple[int, int]:
    """Quantise every ``quantizable`` projection not yet quantised; returns (bytes before, bytes after) of them."""
    modules = dict(model.named_modules())
    before = after = 0
    for name in quantizable(model):
        m = modules[name]
        if m.nf4_shape is not None:
            continue
        before += m.weight.numel() * m.weight.element_size()
        m.quantize_nf4_()
        after += m.nf4().nbytes()
    _drop_freed(model)
    return before, after


def _drop_freed(model) -> None:
    """The adapter's list of the base's trainable parameters keeps only those still held (the rest are freed)."""
    adapter = model.__dict__.get("lora_adapter")
    if adapter is not None:
        live = {id(p) for p in model.parameters()}
        adapter.base_trainable = [p for p in adapter.base_trainable if id(p) in live]


def quantized_modules(model) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.nf4_shape is not None}


def is_quantized(model) -> bool:
    return bool(quantized_modules(model))


def nf4_state(model) -> dict[str, torch.Tensor]:
    """``{"<module>.<buffer>": tensor}`` of every quantised module (safetensors-ready: contiguous, on the CPU)."""
    out = {}
    for name, m in quantized_modules(model).items():
        for buf in NF4_BUFFERS:
            out[f"{name}.{buf}"] = m._buffers[buf].detach().contiguous().cpu()
    return out


def load_nf4_state(model, tensors: dict[str, torch.Tensor], field: str = "--resume") -> None:
    """Hold ``tensors`` (from ``nf4_state``) as the quantised base, quantising modules that are not yet."""
    modules = dict(model.named_modules())
    for name in quantizable(model, field):
        m = modules[name]
        missing = [b for b in NF4_BUFFERS if f"{name}.{b}" not in tensors]
        if missing:
            raise LoraError(field, f"the NF4 base has no tensor {name}.{missing[0]}")
        device = m.bias.device if m.bias is not None else (m.nf4_packed.device if m.nf4_shape else m.weight.device)
        shape = m.nf4_shape or tuple(m.weight.shape)
        m.quantize_nf4_(Nf4Weight(*(tensors[f"{name}.{b}"].to(device) for b in NF4_BUFFERS), shape))
    _drop_freed(model)


@contextlib.contextmanager
def dequantized(model):
    """Each quantised module holds its dequantised weight as a (frozen) parameter inside the block (its forward
    still runs NF4); the parameters are dropped after. A no-op without quantised modules."""
    lent = []
    try:
        for m in quantized_modules(model).values():
            # __getattr__ gives the dequantised tensor; registered past hasattr's check, which that answer fools
            m._parameters["weight"] = nn.Parameter(m.weight, requires_grad=False)
            lent.append(m)
        yield
    finally:
        for m in lent:
            del m.weight
