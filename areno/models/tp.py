"""Tensor parallelism: the collectives with their autograd rules, the sharding plan, and the weight layout math.

The model is written for one device. ``apply_tp_plan`` (at load, on the meta-device model) shrinks parameters to
this rank's shard and tells modules which collective to run; model code never branches on TP itself.

Plan (Megatron style; ``tp`` ranks, rank ``r``):
- column parallel (``qkv_proj``, ``gate_up_proj``): output rows split; the input passes through ``copy_to_tp``
  (identity forward, all-reduce of the gradient backward).
- row parallel (``o_proj``, ``down_proj``): input columns split; the output is all-reduced (``reduce_from_tp``:
  all-reduce forward, identity backward); the bias is replicated and added after the reduction.
- vocab parallel embedding: rows ``[r*V/tp, (r+1)*V/tp)``; ids outside are masked and the output all-reduced.
- vocab parallel LM head: same rows; ``compute_logits`` all-gathers the logits, ``linear_logprobs`` reduces its
  softmax statistics across the group itself.
- attention: query heads split; KV heads split when ``tp <= Hkv``, otherwise replicated (rank ``r`` keeps KV head
  ``r * Hkv // tp``) and their weight gradients summed across the ranks that share them (a gradient hook).
- Qwen3's per-head q/k norm weights are replicated but see only local heads: their gradients are all-reduced (hook).
- MoE: every rank holds all experts, each expert's intermediate dim split (``w13 [E, 2I/tp, H]``, ``w2 [E, H, I/tp]``),
  like a column/row pair per expert: routing is replicated (the router runs identically on every rank, so load
  counters agree), the expert input and routing weights pass through ``copy_to_tp``, the output is all-reduced.
  Expert parallelism (whole experts per rank) would move tokens with all-to-all; at one node with small experts the
  intermediate split keeps every rank's grouped GEMMs the same shape and needs one all-reduce, like a dense MLP.

A parameter's layout maps it to Hugging Face tensors: a list of ``Layout`` (one per expert for stacked experts), each
a concatenation of ``Part`` s along ``dim``. ``pieces`` turns layouts into per-rank copies
``local_param[dst] <-> hf_tensor[src]`` used by the loader, the saver and weight sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

# ---- collectives with the autograd rules of tensor parallelism ---------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


def copy_to_tp(x, group):
    """Identity forward, all-reduce of the gradient backward (a replicated tensor entering a sharded region)."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    """All-reduce forward, identity backward (partial sums leaving a sharded region)."""
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group):
    """All-gather along the last dim forward, this rank's slice of the gradient backward."""
    return x if group is None else _GatherFromTP.apply(x, group)


# ---- weight layouts ------------------------------------------------------------------------------------------------


@dataclass
class Part:
    hf_name: str
    size: int  # extent along the layout's dim in the full Hugging Face tensor
    shape: tuple  # full Hugging Face shape
    kind: str = "plain"  # "plain" (even split) or "kv" (KV heads of ``unit`` rows: split or replicated)
    unit: int = 1
    offset: int = 0  # where the part starts along ``dim`` in the Hugging Face tensor (several parts of one tensor)


@dataclass
class Layout:
    dim: int  # the concatenation dim of the parts, and the shard dim when the parameter is sharded
    parts: list[Part]
    expert: int | None = None  # index on the parameter's leading expert axis (stacked experts)
    sharded: bool = field(default=False)


@dataclass
class Piece:
    hf_name: str
    hf_shape: tuple
    dst: tuple  # index into the local parameter
    src: tuple  # index into the full Hugging Face tensor


def layout(param_shape, dim, parts, expert=None):
    """A Layout for a parameter of full shape ``param_shape`` built from ``[(hf_name, size, kind, unit), ...]``; a
    part that is a slice of a larger Hugging Face tensor is ``(hf_name, size, kind, unit, offset, hf_extent)``."""
    hf_shape = list(param_shape[1:] if expert is not None else param_shape)
    out = []
    for name, size, *rest in parts:
        shape = list(hf_shape)
        if shape:  # a 0-d tensor (a kept scalar) is one part of shape ()
            shape[dim] = rest[3] if len(rest) > 3 else size
        out.append(Part(name, size, tuple(shape), *rest[:3]))
    return Layout(dim, out, expert)


def one_layout(name: str, size: int, *shape) -> list:
    """The layout of a parameter that is exactly one Hugging Face tensor (split along dim 0 when sharded)."""
    return [layout((size, *shape), 0, [(name, size)])]


def part_range(part: Part, sharded: bool, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of ``part`` held by ``rank`` of ``size``."""
    if not sharded or size == 1:
        return 0, part.size
    if part.kind == "kv":
        heads = part.size // part.unit
        if size <= heads:
            n = heads // size
            return rank * n * part.unit, n * part.unit
        return (rank * heads // size) * part.unit, part.unit
    n = part.size // size
    return rank * n, n


def pieces(layouts: list[Layout], rank: int, size: int) -> list[Piece]:
    out = []
    for lay in layouts:
        offset = 0
        for part in lay.parts:
            start, length = part_range(part, lay.sharded, rank, size)
            dst = [slice(None)] * len(part.shape)
            src = [slice(None)] * len(part.shape)
            if part.shape:
                dst[lay.dim] = slice(offset, offset + length)
                src[lay.dim] = slice(part.offset + start, part.offset + start + length)
            if lay.expert is not None:
                dst = [lay.expert, *dst]
            out.append(Piece(part.hf_name, part.shape, tuple(dst), tuple(src)))
            offset += length
    return out


def local_shape(full_shape, layouts: list[Layout], rank: int, size: int) -> tuple:
    lay = layouts[0]
    extent = sum(part_range(p, lay.sharded, rank, size)[1] for p in lay.parts)
    shape = list(full_shape)
    shape[lay.dim + (1 if lay.expert is not None else 0)] = extent
    return tuple(shape)


# ---- the plan ---------------------------------------------------------------------------------------------------

# module-name suffix -> style; parameters of these modules are sharded along their layout dim (row bias excepted)
PLAN = {
    "self_attn.qkv_proj": "column",
    "self_attn.o_proj": "row",
    "mlp.gate_up_proj": "column",
    "mlp.down_proj": "row",
    "mlp.experts": "experts",
    "embed_tokens": "vocab",
    "lm_head": "vocab",
    "self_attn.q_norm": "partial_grad",
    "self_attn.k_norm": "partial_grad",
    # bailing_hybrid: KDA (heads split; the conv kernels and decay parameters follow their channels) and MLA (heads
    # split in q, kv_b and the output gate; the latent projections replicated), the MoE's shared expert
    "self_attn.conv": "column",
    "self_attn.decay": "column",
    "self_attn.f_proj": "column",
    "self_attn.f_b_proj": "column",  # kimi_linear: the low-rank gates' second factor (the first replicated)
    "self_attn.g_b_proj": "column",
    "self_attn.b_proj": "column",
    "self_attn.g_proj": "column",
    "self_attn.o_norm": "partial_grad",
    "self_attn.q_proj": "column",
    "self_attn.q_b_proj": "column",
    "self_attn.kv_b_proj": "column",
    "shared_experts.gate_up_proj": "column",
    "shared_experts.down_proj": "row",
    # qwen3_5: the gated delta net (q/k/v/z/b/a projections, conv channels and decay split by heads; the output
    # norm replicated over local heads), the shared expert
    "self_attn.in_proj": "column",
    "self_attn.out_proj": "row",
    "self_attn.norm": "partial_grad",
    "shared_expert.gate_up_proj": "column",
    "shared_expert.down_proj": "row",
    # olmo2: the QK-norm over the whole projection, its weight split with the heads (sums of squares all-reduced)
    "self_attn.q_proj_norm": "column",
    "self_attn.k_proj_norm": "column",
    # gpt_oss: the attention sinks, one per query head
    "self_attn.sink": "column",
}


def _style(module_name: str) -> str | None:
    for suffix, style in PLAN.items():
        if module_name == suffix or module_name.endswith("." + suffix):
            return style
    return None


def is_sharded(style: str | None, pname: str) -> bool:
    """Whether parameter ``pname`` of a module of TP style ``style`` is split over the ranks (a row-parallel
    module's bias is replicated)."""
    return style in ("column", "vocab", "experts") or (style == "row" and pname == "weight")


def param_is_sharded(param_name: str) -> bool:
    """``is_sharded`` for a model parameter's full name (``layers.0.mlp.down_proj.weight``), TP applied or not."""
    module, _, pname = param_name.rpartition(".")
    return is_sharded(_style(module), pname)


def runs(lay: Layout, rank: int, size: int) -> list[tuple[int, int, int]]:
    """``(local start, full start, length)`` along ``lay.dim`` of each part a rank holds of a sharded parameter:
    where its rows (or columns) sit in the full, unsharded parameter (the parts concatenated whole)."""
    out, local, full = [], 0, 0
    for part in lay.parts:
        start, length = part_range(part, True, rank, size)
        out.append((local, full + start, length))
        local, full = local + length, full + part.size
    return out


def check_divisible(cfg, size: int) -> None:
    """TP must divide query heads, intermediate sizes and the vocabulary; KV heads divide or are divided by it."""
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if getattr(cfg, "linear_num_heads", 0) % size:  # kimi_linear's KDA heads
        problems.append(f"linear_num_heads={cfg.linear_num_heads}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads} (must divide or be divided by the TP size)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % size:
        problems.append(f"moe_intermediate_size={cfg.moe_intermediate_size}")
    if cfg.vocab_size % size:
        problems.append(f"vocab_size={cfg.vocab_size}")
    if problems:
        raise ValueError(f"--tp-size {size} does not divide " + ", ".join(problems))


def apply_tp_plan(model: nn.Module, group) -> None:
    """Shard a meta-device model for this rank of ``group``: parameter shapes, module styles, head counts."""
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    check_divisible(model.config, size)
    layouts = model.hf_layouts()
    model.tp_group, model.tp_rank, model.tp_size = (group if size > 1 else None), rank, size
    model._tp_layouts = layouts
    if size > 1:
        shard_modules(model, layouts, group, model.config.vocab_size)


def shard_modules(root: nn.Module, layouts: dict, group, vocab_size: int, styles: dict | None = None) -> None:
    """Shard the meta-device modules of ``root`` for this rank of ``group`` by the plan (``styles``: module name ->
    style, beside ``PLAN``'s suffixes): parameter shapes (their ``layouts`` marked sharded), module styles and
    groups, vocab ranges, head counts. The model's own plan, and the MTP draft's (``areno.models.mtp``)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for mname, module in root.named_modules():
        style = (styles or {}).get(mname) or _style(mname)
        if style is None:
            continue
        module.tp_group, module.tp_style = group, style
        for pname, param in list(module.named_parameters(recurse=False)):
            lays = layouts[f"{mname}.{pname}"]
            sharded = is_sharded(style, pname)
            for lay in lays:
                lay.sharded = sharded
            shape = local_shape(param.shape, lays, rank, size)
            new = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device), param.requires_grad)
            setattr(module, pname, new)
        if style == "vocab":
            n = vocab_size // size
            module.vocab_start, module.vocab_end = rank * n, (rank + 1) * n
    for module in root.modules():
        if hasattr(module, "shard_heads"):
            module.shard_heads(rank, size)


def register_grad_hooks(model: nn.Module) -> None:
    """After materialisation: sum the partial gradients of replicated parameters used inside sharded regions."""
    group, size, rank = model.tp_group, model.tp_size, model.tp_rank
    if group is None:
        return
    for pname, param in model.named_parameters():  # the optimizer counts these once in the grad norm
        lays = model._tp_layouts.get(pname, [])
        param.tp_replicated = not any(lay.sharded for lay in lays)
    for mname, module in model.named_modules():
        style = getattr(module, "tp_style", None)
        if style == "partial_grad":
            module.weight.register_hook(_all_reduce_hook(group))
        elif style == "column" and mname.endswith("qkv_proj"):
            for pname, param in module.named_parameters(recurse=False):
                lay = model._tp_layouts[f"{mname}.{pname}"][0]
                if any(p.kind == "kv" and p.size // p.unit < size for p in lay.parts):  # replicated KV heads
                    param.register_hook(kv_replica_hook(lay, group, rank, size))


def _all_reduce_hook(group):
    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


def kv_replica_hook(lay: Layout, group, rank: int, size: int):
    """Sum the gradient of replicated KV-head rows over the ranks sharing them (scatter into a full buffer)."""

    def hook(grad):
        grad = grad.clone()
        offset = 0
        for part in lay.parts:
            start, length = part_range(part, True, rank, size)
            if part.kind == "kv":
                full = grad.new_zeros((part.size, *grad.shape[1:]))
                full[start : start + length] = grad[offset : offset + length]
                dist.all_reduce(full, group=group)
                grad[offset : offset + length] = full[start : start + length]
            offset += length
        return grad

    return hook
