"""FP8 rollout (``--rollout-dtype fp8``): the rollout engine's linear projections held as blockwise E4M3 copies.

Format: kernels/fp8.py's (DeepSeek-V3 / vLLM: one fp32 scale per 128 x 128 weight block, activations per token and
128 columns, partial edge blocks, no padding). Which layers (``fp8_modules``): every ``Linear`` of the model but
``lm_head``, the MoE routers, a media tower or projector, and MLA's ``kv_b_proj`` (its decode kernel absorbs the
weight). Embeddings and norms are not ``Linear``; MoE experts stay bf16 (the grouped expert kernels read bf16
stacks: an FP8 grouped GEMM is not built). Each module keeps its weight and holds the copy beside it
(``Linear.set_fp8_``): the copy is read only inside ``fp8_forward`` (colocated rollout: the engine's generate, the
trainer's own forward stays bf16) or always after ``enable`` (a server, a split-mode rollout rank).

When the copy is (re)made: at load (``quantize``), and whenever the engine receives new weights: colocated, before
the first rollout after an optimizer step (the trainer's bf16 weights quantised again, in place); split mode, the
policy stream carries the copy itself (``wire_specs``/``wire_tensors``/``receive``: per module ``fp8:<module>.q``,
float8_e4m3fn ``[N, K]``, and ``fp8:<module>.s``, fp32 ``[ceil(N/128), ceil(K/128)]``, instead of its Hugging Face
weight tensors: about half the bytes). A split-mode rollout rank's weight becomes the dequantised copy, so whatever
reads ``.weight`` there sees what the FP8 forward computes with.

Not built, refused (``ConfigError`` naming --rollout-dtype): tensor parallelism, LoRA adapters, QLoRA's NF4 base.
"""

from __future__ import annotations

import contextlib

import torch

from areno.config.fields import ConfigError
from areno.kernels.fp8 import BLOCK, FP8, Fp8Weight, dequantize_weight_fp8, quantize_weight_fp8
from areno.models.layers import Linear

FIELD = "--rollout-dtype"
PREFIX = "fp8:"


def check(model, field: str = FIELD) -> None:
    """Refuse, in one line naming ``field``, what FP8 rollout does not build for ``model``."""
    if getattr(model, "tp_size", 1) > 1:
        raise ConfigError(field, "fp8 with tensor parallelism is not built yet (the FP8 blocks sharded with their "
                                 "layers)")
    if model.__dict__.get("lora_adapter") is not None:
        raise ConfigError(field, "fp8 with a LoRA adapter is not built yet (the adapter's unmerged forward reads the "
                                 "bf16 base)")
    if any(isinstance(m, Linear) and m.nf4_shape is not None for m in model.modules()):
        raise ConfigError(field, "fp8 with --quantize-base nf4 is not built (the base is NF4 already)")


def fp8_modules(model) -> dict[str, Linear]:
    """``{name: Linear}`` of the projections FP8 rollout quantises, in module order."""
    routers = {id(m.gate) for m in model.modules() if getattr(m, "has_router", False) and hasattr(m, "gate")}
    media = {id(p) for p in [*model.tower_parameters(), *model.projector_parameters()]}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, Linear) and name != "lm_head" and not name.endswith("kv_b_proj")
            and id(m) not in routers and m.nf4_shape is None and id(m.weight) not in media}  # fmt: skip


def is_fp8(model) -> bool:
    return any(isinstance(m, Linear) and "fp8_qweight" in m._buffers for m in model.modules())


@torch.no_grad()
def quantize(model) -> tuple[int, int]:
    """(Re)make every module's FP8 copy from its weight (in place after the first time); returns (bytes of the
    weights, bytes of the copies)."""
    check(model)
    before = after = 0
    for m in fp8_modules(model).values():
        m.set_fp8_()
        before += m.weight.numel() * m.weight.element_size()
        after += m.fp8().nbytes()
    return before, after


def set_active(model, on: bool) -> None:
    for m in fp8_modules(model).values():
        m.fp8_on = on and "fp8_qweight" in m._buffers


def enable(model) -> tuple[int, int]:
    """Quantise and run every forward through the copies from now on (a server, a split-mode rollout rank)."""
    sizes = quantize(model)
    set_active(model, True)
    return sizes


@contextlib.contextmanager
def fp8_forward(model, on: bool = True):
    """The quantised modules run FP8 inside the block (``on``; else their weights), as before after it."""
    before = [(m, m.fp8_on) for m in fp8_modules(model).values()]
    set_active(model, on)
    try:
        yield
    finally:
        for m, was in before:
            m.fp8_on = was


# ---- split mode's wire format ------------------------------------------------------------------------------------
def wire_hf_names(model) -> set[str]:
    """The Hugging Face tensors the FP8 entries replace in the stream: those of the quantised modules' weights."""
    layouts = model._tp_layouts
    mine = {f"{name}.weight" for name in fp8_modules(model)}
    names = {part.hf_name for p in mine for lay in layouts[p] for part in lay.parts}
    shared = [part.hf_name for p, lays in layouts.items() if p not in mine for lay in lays for part in lay.parts
              if part.hf_name in names]  # fmt: skip
    if shared:  # a tensor split between a quantised module and another parameter: the stream cannot carry it
        raise ConfigError(FIELD, f"fp8 in split mode is not built for {model.config.model_type}: {shared[0]} feeds "
                                 "a quantised projection and another parameter")
    return names


def wire_specs(model, *, trainable_only: bool = False) -> list[tuple[str, tuple, torch.dtype]]:
    """``(name, shape, dtype)`` of the FP8 entries (``trainable_only``: of modules whose weight trains)."""
    out = []
    for name, m in fp8_modules(model).items():
        if trainable_only and not m.weight.requires_grad:
            continue
        n, k = m.weight.shape
        out += [(f"{PREFIX}{name}.q", (n, k), FP8), (f"{PREFIX}{name}.s", (-(-n // BLOCK), -(-k // BLOCK)),
                                                     torch.float32)]
    return out


@torch.no_grad()
def wire_tensors(model):
    """``(name, tensor)`` of every FP8 entry, quantised from the current weights (the trainer's side)."""
    for name, m in fp8_modules(model).items():
        q = quantize_weight_fp8(m.weight)
        yield f"{PREFIX}{name}.q", q.qweight
        yield f"{PREFIX}{name}.s", q.scale


def held_wire_tensors(model):
    """``(name, tensor)`` of the FP8 copies a rollout rank holds (the verified sync's other side)."""
    for name, m in fp8_modules(model).items():
        yield f"{PREFIX}{name}.q", m.fp8_qweight
        yield f"{PREFIX}{name}.s", m.fp8_scale


@torch.no_grad()
def receive(modules: dict[str, Linear], name: str, tensor: torch.Tensor) -> None:
    """Copy a received FP8 entry into its module's copy (``modules``: ``fp8_modules``' answer); after the scale
    (each module's last entry) the module's weight is set to the dequantised copy."""
    module, _, part = name.removeprefix(PREFIX).rpartition(".")
    m = modules[module]
    if part == "q":
        m.fp8_qweight.copy_(tensor)
        return
    m.fp8_scale.copy_(tensor)
    m.weight.copy_(dequantize_weight_fp8(Fp8Weight(m.fp8_qweight, m.fp8_scale), m.weight.dtype))
