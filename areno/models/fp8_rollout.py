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
Embeddings and norms are not ``Linear``; while FP8 runs on cuBLAS's GEMM, the decoder layers' hidden-size norms and
the SwiGLU MLPs quantise their own output for the projections that read it (``act_norms``, ``layers.with_fp8_act``:
the norm / activation kernel writes the E4M3 copy in the same pass, saving qkv, gate_up and down their activation
kernel; o_proj's input, the attention output, is quantised by fp8_linear). Each module keeps its weights and holds
the copies beside them (``layers.hold_fp8_``: buffers ``fp8_qweight``/``fp8_scale``, ``fp8_w13_qweight``/... for
experts): the copies are read only inside ``fp8_forward`` (colocated rollout: the engine's generate, the trainer's
own forward stays bf16) or always after ``enable`` (a server, a split-mode rollout rank).

When the copies are (re)made: at load (``quantize``), and whenever the engine receives new weights: colocated,
before the first rollout after an optimizer step (the trainer's bf16 weights quantised again, in place; expert
stacks a few experts at a time); split mode, the policy stream carries the copies themselves
(``wire_specs``/``wire_tensors``/``receive``: per quantised parameter ``fp8:<parameter>.q``, float8_e4m3fn of the
parameter's shape, and ``fp8:<parameter>.s``, fp32 ``[(E,) ceil(N/128), ceil(K/128)]``, e.g.
``fp8:layers.0.mlp.down_proj.weight.q`` or ``fp8:layers.0.mlp.experts.w13.s``, instead of its Hugging Face weight
tensors: about half the bytes, ``wire_bytes``). A split-mode rollout rank's weights become the dequantised copies,
so whatever reads them there sees what the FP8 forward computes with.

Tensor parallelism (``--tp-size``, ``--rollout-tp-size``, serve's ``--tp-size``): each rank quantises its own shard
(column-parallel q/k/v and gate/up: output rows; row-parallel o/down: input columns, whose FP8 partial products
``Linear`` all-reduces as the bf16 ones; experts: their intermediate slice, w13 rows and w2 columns). The shards must
lie on the full weight's block grid (``check_grid``): every part a rank holds starts and ends on a multiple of 128
rows (columns) of the full parameter, the last partial block of both excepted, so a shard's blocks are exactly the
full weight's, its activations' 128-column groups too, and TP=N computes TP=1's numbers up to the all-reduce's
summation order (tests/engine/test_engine_fp8_tp.py checks it against a TP=1 engine on the dequantised shards).
Chosen over blocks aligned to each shard (which would fit any width but differ from TP=1 and need the trainer to
quantise per rollout rank): the copies are one thing at any TP size, like Hub FP8 checkpoints, whose shards vLLM and
SGLang refuse off the grid too. Off the grid (Qwen3-30B-A3B's ``moe_intermediate_size`` 768 at TP 4, heads of 64
with a KV head per rank, ...) is refused before launch (``check_checkpoint``, cli) naming the dimension. A ``Linear``
whose layout ends in per-head scalars names them in ``fp8_kept_parts`` (Qwen3.5's ``in_proj``: its b and a rows, off
the grid at any TP size): at every TP size those rows stay in the model's dtype (``fp8_rows``: the copy covers the
rows before them; their own GEMM beside the FP8 one) and stream as their Hub tensors. Split mode's entries are always
the full parameters' (``gather_full`` on a trainer with TP: each rank quantises its shard, an all-gather assembles
them; bytes halved as without TP); each rollout rank copies its shard's codes and block scales out of them
(``receive``), so no rollout rank quantises; the verified sync gathers the rollout ranks' copies the same way.

Bytes (``wire_bytes``; the whole policy stream in parentheses): Qwen3-30B-A3B's experts 57.98 GB bf16 -> 29.00 GB
fp8 (stream 61.06 GB -> 31.17 GB, 0.51x; with bf16 experts it was 60.16 GB); the tiny test Qwen3-MoE's experts
196,608 -> 98,432 bytes (stream 504,576 -> 381,840).

Not built, refused (``ConfigError`` naming --rollout-dtype): LoRA adapters, QLoRA's NF4 base; TP shards off the
block grid.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from areno.config.fields import ConfigError
from areno.kernels.fp8 import BLOCK, EXPERT_CHUNK, FP8, Fp8Weight, dequantize_weight_fp8, quantize_weight_fp8
from areno.models import tp
from areno.models.layers import Linear, RMSNorm, fp8_buffer_names, held_fp8

FIELD = "--rollout-dtype"
PREFIX = "fp8:"


def check(model, field: str = FIELD) -> None:
    """Refuse, in one line naming ``field``, what FP8 rollout does not build for ``model`` (under TP: a shard off
    the full weight's block grid, ``check_grid``)."""
    check_grid(model, getattr(model, "tp_size", 1), field)
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
    for name, m in fp8_modules(model).items():
        if isinstance(m, Linear):
            m.fp8_rows = _rows(model, f"{name}.weight")
        m.set_fp8_()
        for p in m.fp8_params:
            w = _region(model, f"{name}.{p}")
            before += w.numel() * w.element_size()
            after += held_fp8(m, p).nbytes()
    return before, after


def act_norms(model) -> list[nn.Module]:
    """The norms whose output FP8 projections read (``RMSNorm.fp8_act_source``, hidden size wide, inside the decoder
    layers: their input and post-attention norms; not the final norm, whose output lm_head reads in bf16): while FP8
    runs they quantise it themselves (``RMSNorm.fp8_act``)."""
    hidden = getattr(model.config, "hidden_size", None)
    layers = getattr(model, "layers", None)
    return [m for m in (layers.modules() if isinstance(layers, nn.Module) else ())
            if isinstance(m, RMSNorm) and m.fp8_act_source and m.weight.shape[0] == hidden]  # fmt: skip


def set_active(model, on: bool) -> None:
    """FP8 forward on (the quantised modules read their copies, the norms feeding them quantise their output) or
    off."""
    modules = fp8_modules(model).values()
    for m in modules:
        m.fp8_on = on and _held(m)
    active = any(m.fp8_on for m in modules)
    for m in act_norms(model):
        m.fp8_act = active


def enable(model) -> tuple[int, int]:
    """Quantise and run every forward through the copies from now on (a server, a split-mode rollout rank)."""
    sizes = quantize(model)
    set_active(model, True)
    return sizes


@contextlib.contextmanager
def fp8_forward(model, on: bool = True):
    """The quantised modules run FP8 inside the block (``on``; else their weights), as before after it."""
    before = [(m, m.fp8_on) for m in fp8_modules(model).values()]
    norms = [(m, m.fp8_act) for m in act_norms(model)]
    set_active(model, on)
    try:
        yield
    finally:
        for m, was in before:
            m.fp8_on = was
        for m, was in norms:
            m.fp8_act = was


def wire_bytes(model) -> tuple[int, int]:
    """(bf16 bytes, FP8-entry bytes) of the quantised parameters: what split mode's stream carries for them
    without and with FP8 (no quantisation, shapes only: any model, meta tensors included)."""
    bf16 = sum(torch.Size(_full_shape(model, n, _region(model, n))).numel() * 2 for n in fp8_params(model))
    fp8 = sum(torch.Size(shape).numel() * (4 if dtype == torch.float32 else 1) for _, shape, dtype in wire_specs(model))
    return bf16, fp8


# ---- tensor parallelism: every rank's shard on the full weight's block grid ------------------------------------
def _sharding(model, pname: str, size: int):
    """``(parameter dim, layout)`` along which a quantised parameter is split over ``size`` TP ranks; None when it
    is replicated (or without TP)."""
    lays = model._tp_layouts[pname]
    if size == 1 or not tp.param_is_sharded(pname):
        return None
    return lays[0].dim + (lays[0].expert is not None), lays[0]


def _quantised(model, pname: str) -> int:
    """How many of the parameter's layout parts the FP8 copy covers: all but a ``Linear``'s ``fp8_kept_parts``
    (trailing rows left in the model's dtype: Qwen3.5's b and a, a scalar per value head, which no TP size would
    keep on the block grid; vLLM leaves its ``in_proj_ba`` unquantised too)."""
    module, _, p = pname.rpartition(".")
    kept = getattr(model.get_submodule(module), "fp8_kept_parts", 0) if p == "weight" else 0
    return len(model._tp_layouts[pname][0].parts) - kept


def _runs(model, pname: str, lay, rank: int, size: int) -> list:
    """``tp.runs`` of the quantised parts."""
    return tp.runs(lay, rank, size)[: _quantised(model, pname)]


def _rows(model, pname: str) -> int | None:
    """The leading rows of this rank's parameter the FP8 copy covers; None: all of it."""
    n = _quantised(model, pname)
    lay = model._tp_layouts[pname][0]
    if n == len(lay.parts):
        return None
    if _sharding(model, pname, model.tp_size) is None:
        return sum(part.size for part in lay.parts[:n])
    return sum(length for _, _, length in _runs(model, pname, lay, model.tp_rank, model.tp_size))


def _region(model, pname: str) -> torch.Tensor:
    """The part of this rank's parameter the FP8 copy covers (all of it, or its leading ``_rows``)."""
    module, _, p = pname.rpartition(".")
    w, rows = getattr(model.get_submodule(module), p), _rows(model, pname)
    return w if rows is None else w[:rows]


def _dimension(cfg, part, size: int, length: int) -> str:
    """The model dimension a shard of ``part`` comes from, for the refusal: ``moe_intermediate_size 768 / TP 4 =
    192``, ``4 heads x head_dim 32 / TP 2 = 64``."""
    named = [k for k, v in sorted(vars(cfg).items()) if type(v) is int and v == part.size and k.endswith("_size")
             and k not in ("hidden_size", "vocab_size")]  # (never split)
    named.sort(key=lambda k: ("moe" in k) != (".experts." in part.hf_name))  # an expert's: moe_intermediate_size
    if part.unit > 1 or part.size == cfg.num_heads * cfg.head_dim:
        unit = part.unit if part.unit > 1 else cfg.head_dim
        what = f"{part.size // unit} heads x head_dim {unit}"
    else:
        what = f"{named[0]} {part.size}" if named else f"{part.size}"
    return f"{what} / TP {size} = {length}" if length * size == part.size else f"{what}, {length} on a rank"


def check_grid(model, size: int, field: str = FIELD) -> None:
    """FP8 copies under TP ``size`` are the full weight's, sliced: each rank quantises its own shard, which must
    start and end on the full weight's 128-row (column) block edges, so its blocks are exactly the full weight's
    (vLLM and SGLang refuse a block-FP8 shard off the grid too). ``ConfigError`` naming ``field``, the parameter
    and the model dimension otherwise. Works on an unsharded (even meta-device) model for a TP size to come."""
    if size == 1:
        return
    for pname in fp8_params(model):
        sharding = _sharding(model, pname, size)
        if sharding is None:
            continue
        dim, lay = sharding
        extent = sum(p.size for p in lay.parts[: _quantised(model, pname)])
        for rank in range(size):
            mine = _runs(model, pname, lay, rank, size)
            held = sum(n for _, _, n in mine)
            for (local, full, n), part in zip(mine, lay.parts):
                tail = full + n == extent and local + n == held  # the last, partial block of both
                if local % BLOCK or full % BLOCK or (n % BLOCK and not tail):
                    raise ConfigError(field, f"fp8 with TP {size} needs every shard on the 128 x 128 block grid of "
                                             f"the full weight: {pname}'s shard of {part.hf_name} is "
                                             f"{_dimension(model.config, part, size, n)} "
                                             f"{'rows' if dim == (lay.expert is not None) else 'columns'}, not a "
                                             "multiple of 128 (use a TP size that keeps it one, or bf16)")


def check_checkpoint(value, size: int, field: str = FIELD) -> None:
    """Before launch: ``check_grid`` of a local checkpoint's model (built on the meta device, no weights read) for
    an engine of TP ``size``; a Hub id is checked when the engine loads it."""
    folder = Path(str(value)).expanduser()
    if size > 1 and (folder / "config.json").is_file():
        from areno.models.loader import meta_model

        check_grid(meta_model(folder)[0], size, field)


def _full_shape(model, pname: str, region: torch.Tensor) -> tuple:
    """The shape of the full parameter's quantised region, from this rank's (``_region``)."""
    sharding = _sharding(model, pname, model.tp_size)
    shape = list(region.shape)
    if sharding is not None:
        shape[sharding[0]] = sum(p.size for p in sharding[1].parts[: _quantised(model, pname)])
    return tuple(shape)


def _spans(model, pname: str, rank: int):
    """``(dim, [(local start, full start, length)])`` of this parameter's shard at ``rank``, in weight rows or
    columns; None when replicated."""
    sharding = _sharding(model, pname, model.tp_size)
    return None if sharding is None else (sharding[0], _runs(model, pname, sharding[1], rank, model.tp_size))


def _blocks(span: tuple) -> tuple:
    local, full, n = span
    return local // BLOCK, full // BLOCK, -(-n // BLOCK)


@torch.no_grad()
def gather_full(model, pname: str, q: Fp8Weight) -> Fp8Weight:
    """The full parameter's FP8 copy from every TP rank's shard copy ``q`` (an all-gather over the TP group; on
    the grid ``check_grid`` keeps, exactly what quantising the full weight gives); ``q`` itself without TP."""
    if _spans(model, pname, 0) is None:
        return q
    codes = q.qweight.view(torch.uint8).contiguous()
    full_q = codes.new_empty(_full_shape(model, pname, codes))
    full_s = q.scale.new_empty((*full_q.shape[:-2], -(-full_q.shape[-2] // BLOCK), -(-full_q.shape[-1] // BLOCK)))
    parts_q = [torch.empty_like(codes) for _ in range(model.tp_size)]
    parts_s = [torch.empty_like(q.scale) for _ in range(model.tp_size)]
    dist.all_gather(parts_q, codes, group=model.tp_group)
    dist.all_gather(parts_s, q.scale.contiguous(), group=model.tp_group)
    for rank in range(model.tp_size):
        dim, spans = _spans(model, pname, rank)
        for span in spans:
            local, full, n = span
            full_q.narrow(dim, full, n).copy_(parts_q[rank].narrow(dim, local, n))
            local, full, n = _blocks(span)
            full_s.narrow(dim, full, n).copy_(parts_s[rank].narrow(dim, local, n))
    return Fp8Weight(full_q.view(FP8), full_s)


def _copy_shard(model, pname: str, dst: torch.Tensor, full: torch.Tensor, scale: bool) -> None:
    """This rank's shard of a full FP8 entry (codes, or ``scale``s) into ``dst``."""
    spans = _spans(model, pname, model.tp_rank)
    if spans is None:
        dst.copy_(full)
        return
    dim, spans = spans
    for span in spans:
        local, start, n = _blocks(span) if scale else span
        dst.narrow(dim, local, n).copy_(full.narrow(dim, start, n))


# ---- split mode's wire format ------------------------------------------------------------------------------------
def wire_hf_names(model) -> set[str]:
    """The Hugging Face tensors the FP8 entries replace in the stream: those of the quantised parameters (kept
    trailing parts, ``fp8_kept_parts``, stream as they are)."""
    layouts = model._tp_layouts
    mine = set(fp8_params(model))
    names = {part.hf_name for p in mine for lay in layouts[p] for part in lay.parts[: _quantised(model, p)]}
    shared = [part.hf_name for p, lays in layouts.items() if p not in mine for lay in lays for part in lay.parts
              if part.hf_name in names]  # fmt: skip
    if shared:  # a tensor split between a quantised module and another parameter: the stream cannot carry it
        raise ConfigError(FIELD, f"fp8 in split mode is not built for {model.config.model_type}: {shared[0]} feeds "
                                 "a quantised projection and another parameter")
    return names


def _streamed(w) -> bool:
    return w.requires_grad or getattr(w, "streamed", False)


def wire_specs(model, *, trainable_only: bool = False) -> list[tuple[str, tuple, torch.dtype]]:
    """``(name, shape, dtype)`` of the FP8 entries, the full parameters' (``trainable_only``: of parameters whose
    weight is streamed)."""
    out = []
    for name, (m, p) in fp8_params(model).items():
        if trainable_only and not _streamed(getattr(m, p)):
            continue
        shape = _full_shape(model, name, _region(model, name))
        *lead, n, k = shape
        out += [(f"{PREFIX}{name}.q", shape, FP8),
                (f"{PREFIX}{name}.s", (*lead, -(-n // BLOCK), -(-k // BLOCK)), torch.float32)]  # fmt: skip
    return out


@torch.no_grad()
def wire_tensors(model):
    """``(name, tensor)`` of every FP8 entry, quantised from the current weights (the trainer's side; under TP each
    rank quantises its shard and the full copies are gathered: a collective over the TP group)."""
    for name in fp8_params(model):
        q = gather_full(model, name, quantize_weight_fp8(_region(model, name)))
        yield f"{PREFIX}{name}.q", q.qweight
        yield f"{PREFIX}{name}.s", q.scale


def held_wire_tensors(model):
    """``(name, tensor)`` of the FP8 copies a rollout rank holds, the full parameters' (the verified sync's other
    side; under TP gathered over the TP group)."""
    for name, (m, p) in fp8_params(model).items():
        q = gather_full(model, name, held_fp8(m, p))
        yield f"{PREFIX}{name}.q", q.qweight
        yield f"{PREFIX}{name}.s", q.scale


@torch.no_grad()
def receive(model, modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> None:
    """Copy a received (full) FP8 entry into its module's copy, this TP rank's shard of it (``modules``:
    ``fp8_modules(model)``); after the scale (each parameter's last entry) the parameter is set to the dequantised
    copy (stacked experts a few at a time)."""
    param_name, _, part = name.removeprefix(PREFIX).rpartition(".")
    module, _, param = param_name.rpartition(".")
    m = modules[module]
    qname, sname = fp8_buffer_names(param)
    if part == "q":
        _copy_shard(model, param_name, m._buffers[qname].view(torch.uint8), tensor.view(torch.uint8), False)
        return
    _copy_shard(model, param_name, m._buffers[sname], tensor, True)
    w, q = _region(model, param_name), held_fp8(m, param)
    if w.dim() == 2:
        w.copy_(dequantize_weight_fp8(q, w.dtype))
        return
    for i in range(0, w.shape[0], EXPERT_CHUNK):
        part_q = Fp8Weight(q.qweight[i : i + EXPERT_CHUNK], q.scale[i : i + EXPERT_CHUNK])
        w[i : i + EXPERT_CHUNK].copy_(dequantize_weight_fp8(part_q, w.dtype))
