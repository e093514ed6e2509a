"""FP8 rollout (``--rollout-dtype fp8``): the rollout engine's linear projections and routed experts held as
blockwise E4M3 copies.

Format: kernels/fp8.py's (DeepSeek-V3 / vLLM: one fp32 scale per 128 x 128 weight block, activations per token and
128 columns, partial edge blocks, no padding). What (``fp8_modules``, each naming its quantised parameters in
``fp8_params``): every ``Linear`` of the model but ``lm_head``, the MoE routers, a media tower or projector, and MLA's
``kv_b_proj`` (its decode kernel absorbs the weight); and the routed-experts stacks (``qwen3_moe.Experts``: ``w13``
``[E, 2I, H]`` and ``w2`` ``[E, H, I]``, one scale per 128 x 128 block of each expert, run by ``fused_moe``'s FP8
path, kernels/moe/fp8.py) of every family built on them: Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V3, Ling 3
(``bailing_hybrid``), Kimi-Linear and Gemma 4 (its GeGLU experts too). In a 30B-A3B MoE the experts are 95% of the
weight bytes. GPT-OSS's experts stay bf16 (their biased, clamped SwiGLU runs on kernels/moe/biased.py, which has no
FP8 path; they load as MXFP4 or bf16 stacks of their own); LoRA on experts is refused with any LoRA adapter below.
Embeddings and norms are not ``Linear``. Each module keeps its weights and holds the copies beside them
(``layers.hold_fp8_``: buffers ``fp8_qweight``/``fp8_scale``, ``fp8_w13_qweight``/... for experts): the copies are
read only inside ``fp8_forward`` (colocated rollout: the engine's generate, the trainer's own forward stays bf16) or
always after ``enable`` (a server, a split-mode rollout rank).

When the copies are (re)made: at load (``quantize``), and whenever the engine receives new weights: colocated,
before the first rollout after an optimizer step (the trainer's bf16 weights quantised again, in place; expert
stacks a few experts at a time); split mode, the policy stream carries the copies themselves
(``wire_specs``/``wire_tensors``/``receive``: per quantised parameter ``fp8:<parameter>.q``, float8_e4m3fn of the
parameter's shape, and ``fp8:<parameter>.s``, fp32 ``[(E,) ceil(N/128), ceil(K/128)]``, e.g.
``fp8:layers.0.mlp.down_proj.weight.q`` or ``fp8:layers.0.mlp.experts.w13.s``, instead of its Hugging Face weight
tensors: about half the bytes, ``wire_bytes``). A split-mode rollout rank's weights become the dequantised copies,
so whatever reads them there sees what the FP8 forward computes with.

Bytes (``wire_bytes``; the whole policy stream in parentheses): Qwen3-30B-A3B's experts 57.98 GB bf16 -> 29.00 GB
fp8 (stream 61.06 GB -> 31.17 GB, 0.51x; with bf16 experts it was 60.16 GB); the tiny test Qwen3-MoE's experts
196,608 -> 98,432 bytes (stream 504,576 -> 381,840).

Not built, refused (``ConfigError`` naming --rollout-dtype): tensor parallelism, LoRA adapters, QLoRA's NF4 base.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from areno.config.fields import ConfigError
from areno.kernels.fp8 import BLOCK, EXPERT_CHUNK, FP8, Fp8Weight, dequantize_weight_fp8, quantize_weight_fp8
from areno.models.layers import Linear, fp8_buffer_names, held_fp8

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


def fp8_modules(model) -> dict[str, nn.Module]:
    """``{name: module}`` of what FP8 rollout quantises, in module order: the ``Linear`` projections and the
    routed-experts stacks (``qwen3_moe.Experts``); each names its quantised parameters in ``fp8_params``."""
    routers = {id(m.gate) for m in model.modules() if getattr(m, "has_router", False) and hasattr(m, "gate")}
    media = {id(p) for p in [*model.tower_parameters(), *model.projector_parameters()]}
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            if (name != "lm_head" and not name.endswith("kv_b_proj") and id(m) not in routers and m.nf4_shape is None
                    and id(m.weight) not in media):  # fmt: skip
                out[name] = m
        elif getattr(m, "fp8_params", None):
            out[name] = m
    return out


def fp8_params(model) -> dict[str, tuple[nn.Module, str]]:
    """``{parameter name: (module, attribute)}`` of every quantised parameter."""
    return {f"{name}.{p}": (m, p) for name, m in fp8_modules(model).items() for p in m.fp8_params}


def _held(m) -> bool:
    return all(fp8_buffer_names(p)[0] in m._buffers for p in m.fp8_params)


def is_fp8(model) -> bool:
    return any(_held(m) for m in fp8_modules(model).values())


@torch.no_grad()
def quantize(model) -> tuple[int, int]:
    """(Re)make every module's FP8 copies from its weights (in place after the first time); returns (bytes of the
    weights, bytes of the copies)."""
    check(model)
    before = after = 0
    for m in fp8_modules(model).values():
        m.set_fp8_()
        for p in m.fp8_params:
            w = getattr(m, p)
            before += w.numel() * w.element_size()
            after += held_fp8(m, p).nbytes()
    return before, after


def set_active(model, on: bool) -> None:
    for m in fp8_modules(model).values():
        m.fp8_on = on and _held(m)


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


def wire_bytes(model) -> tuple[int, int]:
    """(bf16 bytes, FP8-entry bytes) of the quantised parameters: what split mode's stream carries for them
    without and with FP8 (no quantisation, shapes only: any model, meta tensors included)."""
    bf16 = sum(getattr(m, p).numel() * 2 for m, p in fp8_params(model).values())
    fp8 = sum(torch.Size(shape).numel() * (4 if dtype == torch.float32 else 1) for _, shape, dtype in wire_specs(model))
    return bf16, fp8


# ---- split mode's wire format ------------------------------------------------------------------------------------
def wire_hf_names(model) -> set[str]:
    """The Hugging Face tensors the FP8 entries replace in the stream: those of the quantised parameters."""
    layouts = model._tp_layouts
    mine = set(fp8_params(model))
    names = {part.hf_name for p in mine for lay in layouts[p] for part in lay.parts}
    shared = [part.hf_name for p, lays in layouts.items() if p not in mine for lay in lays for part in lay.parts
              if part.hf_name in names]  # fmt: skip
    if shared:  # a tensor split between a quantised module and another parameter: the stream cannot carry it
        raise ConfigError(FIELD, f"fp8 in split mode is not built for {model.config.model_type}: {shared[0]} feeds "
                                 "a quantised projection and another parameter")
    return names


def _streamed(w) -> bool:
    return w.requires_grad or getattr(w, "streamed", False)


def wire_specs(model, *, trainable_only: bool = False) -> list[tuple[str, tuple, torch.dtype]]:
    """``(name, shape, dtype)`` of the FP8 entries (``trainable_only``: of parameters whose weight is streamed)."""
    out = []
    for name, (m, p) in fp8_params(model).items():
        w = getattr(m, p)
        if trainable_only and not _streamed(w):
            continue
        *lead, n, k = w.shape
        out += [(f"{PREFIX}{name}.q", tuple(w.shape), FP8),
                (f"{PREFIX}{name}.s", (*lead, -(-n // BLOCK), -(-k // BLOCK)), torch.float32)]  # fmt: skip
    return out


@torch.no_grad()
def wire_tensors(model):
    """``(name, tensor)`` of every FP8 entry, quantised from the current weights (the trainer's side)."""
    for name, (m, p) in fp8_params(model).items():
        q = quantize_weight_fp8(getattr(m, p))
        yield f"{PREFIX}{name}.q", q.qweight
        yield f"{PREFIX}{name}.s", q.scale


def held_wire_tensors(model):
    """``(name, tensor)`` of the FP8 copies a rollout rank holds (the verified sync's other side)."""
    for name, (m, p) in fp8_params(model).items():
        q = held_fp8(m, p)
        yield f"{PREFIX}{name}.q", q.qweight
        yield f"{PREFIX}{name}.s", q.scale


@torch.no_grad()
def receive(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> None:
    """Copy a received FP8 entry into its module's copy (``modules``: ``fp8_modules``' answer); after the scale
    (each parameter's last entry) the parameter is set to the dequantised copy (stacked experts a few at a time)."""
    param_name, _, part = name.removeprefix(PREFIX).rpartition(".")
    module, _, param = param_name.rpartition(".")
    m = modules[module]
    qname, sname = fp8_buffer_names(param)
    if part == "q":
        m._buffers[qname].copy_(tensor)
        return
    m._buffers[sname].copy_(tensor)
    w, q = getattr(m, param), held_fp8(m, param)
    if w.dim() == 2:
        w.copy_(dequantize_weight_fp8(q, w.dtype))
        return
    for i in range(0, w.shape[0], EXPERT_CHUNK):
        part_q = Fp8Weight(q.qweight[i : i + EXPERT_CHUNK], q.scale[i : i + EXPERT_CHUNK])
        w[i : i + EXPERT_CHUNK].copy_(dequantize_weight_fp8(part_q, w.dtype))
