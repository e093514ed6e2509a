"""LoRA adapters on areno's linear projections: PEFT's math, module names and files; the base frozen; an "adapter off"
switch that gives back the base policy.

An adapter is a set of (A, B) pairs, one per Hugging Face linear module it targets (``model.layers.0.self_attn.q_proj``
...), named and initialised as PEFT does: ``A [r, in]`` kaiming-uniform (a = sqrt 5), ``B [out, r]`` zeros, the delta
``B(A(dropout(x))) * alpha / r`` added to the base projection's output. areno fuses some projections (``qkv_proj`` is
q, k and v; ``gate_up_proj`` is gate and up): ``hf_layouts`` says which output rows each Hugging Face module owns, so
one forward hook on the fused ``Linear`` adds each targeted module's delta to its own rows (in place without TP;
under TP with zero pieces for the rest).

The adapter is not a submodule of the model: the model's parameters, their Hugging Face names, loading, saving and
TP plans are unchanged; ``attach`` freezes the base and hooks the projections; ``disabled()`` runs the base policy
(the reference for KL, no second copy of the weights). Files are PEFT's (``adapter_config.json`` +
``adapter_model.safetensors``, tensors ``base_model.model.<module>.lora_A.weight``), read by
``peft.PeftModel.from_pretrained``.

Under tensor parallelism the adapter is sharded with its layer (``tp_layouts``: its tensors' layouts in
models/tp.py's terms, so the loader's, saver's and policy sync's piece math applies to it unchanged): on a
column-parallel projection ``lora_B`` holds the rows the base weight holds (KV heads replicated as theirs, their
gradients summed the same way), ``lora_A`` is replicated and its rank-wide activation enters the sharded region
through ``copy_to_tp``; on a row-parallel one ``lora_A`` holds the input columns the base weight holds, its rank-wide
partial activation is all-reduced (``[tokens, rank]``: the base's all-reduce happens inside ``Linear``, whose forward
the adapter leaves alone) and ``lora_B`` is replicated. Files are always whole (gathered).

MoE routed experts are PEFT's ``target_parameters`` (``experts.gate_up_proj`` / ``experts.down_proj``, one (A, B) per
expert): models/lora_experts.py; the adapter holds their pairs beside the linear ones (``expert_pairs``).

Not built yet, refused in one line: MLA's ``kv_b_proj`` (absorbed into the decode kernel), a vision tower or
projector (``all-linear`` adapts the language model only), ``--lora-dropout`` with tensor parallelism, expert LoRA
with tensor parallelism or dropout (PEFT's expert adapters have none).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from areno.models import lora_experts
from areno.models.layers import Linear
from areno.models.saver import iter_hf_tensors
from areno.models.tp import Layout, Part, copy_to_tp, kv_replica_hook, local_shape, part_range, pieces, reduce_from_tp

ALL_LINEAR = "all-linear"
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")  # the experts' without "experts."
UNSUPPORTED_PEFT = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None,
                    "layers_to_transform": None, "fan_in_fan_out": False}


class LoraError(ValueError):
    """A LoRA setting or adapter file areno cannot apply; ``field`` names the flag or file field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple | str = ALL_LINEAR  # PEFT module names (suffix match) or "all-linear"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass
class Site:
    """One Hugging Face linear module inside an areno ``Linear``: its output rows ``[offset, offset + rows)``."""

    module: str  # areno module name (``layers.0.self_attn.qkv_proj``)
    hf_module: str  # transformers' (PEFT's) module name (``model.layers.0.self_attn.q_proj``)
    offset: int
    rows: int
    in_features: int  # the full (unsharded) input width
    layout: Layout | None = None  # the base weight's layout (its ``sharded`` flag says whether TP splits it)
    first: int = 0  # the site's parts in ``layout``: ``parts[first : first + count]`` (its rows, or its input)
    count: int = 1

    def span(self, rank: int, size: int) -> tuple[int, int]:
        """(offset, rows) of the site's output rows in ``rank``'s shard of the projection (all rows when the
        projection is row-parallel: its input is what is split)."""
        if self.layout is None or self.layout.dim == 1:
            return self.offset, self.rows
        held = [part_range(p, self.layout.sharded, rank, size)[1] for p in self.layout.parts]
        return sum(held[: self.first]), sum(held[self.first : self.first + self.count])

    def tp_layouts(self, r: int) -> tuple[list[Layout], list[Layout]]:
        """The layouts of its ``lora_A [r, in]`` and ``lora_B [rows, r]`` (PEFT's tensor names)."""
        a_name = f"{PREFIX}{self.hf_module}.lora_A.weight"
        b_name = f"{PREFIX}{self.hf_module}.lora_B.weight"
        lay = self.layout or Layout(0, [Part(self.hf_module, self.rows, (self.rows, self.in_features))])
        if lay.dim == 1:  # row-parallel: A's columns split as the base weight's, B replicated
            p = lay.parts[0]
            a = Layout(1, [Part(a_name, p.size, (r, p.size), p.kind, p.unit)], sharded=lay.sharded)
            return [a], [Layout(0, [Part(b_name, self.rows, (self.rows, r))])]
        parts, start = [], sum(p.size for p in lay.parts[: self.first])
        for p in lay.parts[self.first : self.first + self.count]:
            parts.append(Part(b_name, p.size, (self.rows, r), p.kind, p.unit, start - self.offset))
            start += p.size
        a = Layout(0, [Part(a_name, r, (r, self.in_features))])
        return [a], [Layout(0, parts, sharded=lay.sharded)]


# transformers' module names where they differ from the checkpoint's tensor names (PEFT names modules): Ling 3's
# (BailingMoeV3 in transformers 5) attention.* is self_attn.*, its dense is o_proj, its KDA f_proj sits in forget_gate
PEFT_RENAMES = {"bailing_hybrid": ((".attention.dense", ".self_attn.o_proj"),
                                   (".attention.f_proj", ".self_attn.forget_gate.f_proj"),
                                   (".attention.", ".self_attn."))}


def peft_module(model, checkpoint_module: str) -> str:
    """The module name PEFT gives a checkpoint tensor's module (``model.layers.0.self_attn.q_proj``)."""
    for old, new in PEFT_RENAMES.get(model.config.model_type, ()):
        if old in checkpoint_module:
            return checkpoint_module.replace(old, new, 1)
    return checkpoint_module


def linear_sites(model) -> list[Site]:
    """Every Hugging Face linear module areno's ``Linear`` projections hold, MoE routers and ``lm_head`` excepted
    (PEFT's ``all-linear``: HF routers are not ``nn.Linear``; the output layer is never adapted); a vision tower and
    projector too (not built yet: their frozen path encodes without gradients)."""
    layouts = getattr(model, "_tp_layouts", None) or model.hf_layouts()  # the loaded model's: sharded flags set
    routers = {id(m.gate) for m in model.modules() if getattr(m, "has_router", False) and hasattr(m, "gate")}
    media = {id(p) for p in [*model.tower_parameters(), *model.projector_parameters()]}
    out = []
    for name, module in model.named_modules():  # an NF4 module (QLoRA) holds no weight parameter: never media's
        if (not isinstance(module, Linear) or id(module) in routers or name == "lm_head"
                or id(module._parameters.get("weight")) in media):
            continue
        lays = layouts.get(f"{name}.weight")
        if not lays or len(lays) != 1 or lays[0].expert is not None:
            continue
        lay = lays[0]
        if lay.dim == 1 and len(lay.parts) != 1:
            continue  # a row-concatenation of several modules' inputs: never one PEFT module
        in_features = lay.parts[0].size if lay.dim == 1 else module.weight_shape()[1]
        offset = 0
        for i, part in enumerate(lay.parts):
            rows = part.size if lay.dim == 0 else module.weight_shape()[0]
            hf = peft_module(model, part.hf_name.removesuffix(".weight"))
            last = out[-1] if out else None
            if last is not None and (last.module, last.hf_module, last.offset + last.rows) == (name, hf, offset):
                last.rows += rows  # one Hugging Face tensor held in consecutive parts (Qwen3.5's in_proj_qkv)
                last.count += 1
            elif part.hf_name.endswith(".weight"):
                out.append(Site(name, hf, offset, rows, in_features, lay, i))
            offset += rows if lay.dim == 0 else 0
    return out


def media_modules(model) -> list[str]:
    """The PEFT names of the vision tower's and projector's linear modules."""
    media = {id(p) for p in [*model.tower_parameters(), *model.projector_parameters()]}
    layouts = model.hf_layouts()
    return [peft_module(model, lay.parts[0].hf_name.rsplit(".", 1)[0]) for name, m in model.named_modules()
            if isinstance(m, Linear) and id(m.weight) in media for lay in layouts.get(f"{name}.weight", [])[:1]]


def _matches(hf_module: str, target: str) -> bool:
    return hf_module == target or hf_module.endswith("." + target)


def select_experts(model, spec: LoraSpec) -> list:
    """The MoE expert parameters ``spec.target_modules`` names (none for ``all-linear``)."""
    if spec.target_modules == ALL_LINEAR:
        return []
    return lora_experts.select(model, spec.target_modules, peft_module)


def select_sites(model, spec: LoraSpec, field: str = "--lora-target-modules") -> list[Site]:
    """The sites ``spec.target_modules`` names (PEFT's rule: the module name or its dotted suffix); a name that
    matches nothing (nor an MoE expert parameter: ``select_experts``) and MLA's ``kv_b_proj`` are refused in one
    line."""
    sites = linear_sites(model)
    experts = lora_experts.expert_sites(model, peft_module)
    if spec.target_modules == ALL_LINEAR:
        chosen = sites
    else:
        targets = list(spec.target_modules)
        chosen = [s for s in sites if any(_matches(s.hf_module, t) for t in targets)]
        for t in targets:
            if any(_matches(s.hf_module, t) for s in sites) or any(lora_experts.matches(s, t) for s in experts):
                continue
            if model.is_multimodal and any(_matches(n, t) for n in media_modules(model)):
                raise LoraError(field, f"{t!r}: LoRA on the vision tower or projector is not built yet (the language "
                                       "model's projections are)")
            if not experts and getattr(model, "num_moe_layers", 0) and "experts" in t.split("."):
                raise LoraError(field, f"{t!r}: LoRA on the {model.config.model_type} model's experts is not built "
                                       "yet (its biased, interleaved gate/up experts; qwen3_moe's layout is)")
            if experts and t in EXPERT_NAMES:
                raise LoraError(field, f"{t!r} names no linear module of the {model.config.model_type} model: its "
                                       "routed experts are PEFT's target_parameters experts.gate_up_proj and "
                                       "experts.down_proj; name those")
            raise LoraError(field, f"{t!r} names no linear module of the {model.config.model_type} model")
    seen, split = set(), None
    for s in chosen:
        split = split or (s.hf_module if s.hf_module in seen else None)
        seen.add(s.hf_module)
    if split:
        raise LoraError(field, f"{split}: a module areno holds in rows apart (interleaved with another) is not built "
                               "yet; name the modules to adapt")
    absorbed = [s.hf_module for s in chosen if s.hf_module.endswith("kv_b_proj")]
    if absorbed:
        if spec.target_modules != ALL_LINEAR:
            raise LoraError(field, f"{absorbed[0]}: LoRA on MLA's kv_b_proj (absorbed into the decode kernel) is "
                                   "not built yet")
        raise LoraError(field, "all-linear on an MLA model includes kv_b_proj (absorbed into the decode kernel), "
                               "not built yet; name the modules to adapt")
    if not chosen and not select_experts(model, spec):
        raise LoraError(field, f"no linear module to adapt in the {model.config.model_type} model")
    return chosen


class LoraPair(nn.Module):
    """PEFT's ``lora_A``/``lora_B`` of one module: ``B(A(dropout(x))) * scaling``; under TP each holds its shard
    (``style``: the projection's, ``group``: its TP group)."""

    def __init__(self, in_features: int, out_features: int, spec: LoraSpec, dtype=None, device=None):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(spec.rank, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, spec.rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's default, as PEFT's init_lora_weights
        self.dropout = spec.dropout
        self.scaling = spec.scaling
        self.style, self.group = None, None

    def forward(self, x, training: bool = False):
        """``training``: the adapted model's mode (dropout only while it trains: never in rollout or eval)."""
        x = x.to(self.lora_A.dtype)
        if self.dropout > 0 and training:
            x = torch.nn.functional.dropout(x, self.dropout, training=True)
        h = x @ self.lora_A.t()
        if self.style == "row":  # partial sums over this rank's input columns
            h = reduce_from_tp(h, self.group)
        elif self.style == "column":  # replicated, entering this rank's rows (its gradient summed backward)
            h = copy_to_tp(h, self.group)
        return h @ self.lora_B.t() * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``B A * scaling``: what merging adds to the module's weight ``[out, in]`` (this rank's shard of it)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def shard(self, a_lay: Layout, b_lay: Layout, rank: int, size: int, group, style: str | None) -> None:
        """Keep ``rank``'s shard of A and B (A drawn whole and made equal over the group first, as one device draws
        it); gradient hooks where B replicates KV heads."""
        self.style, self.group = style, group
        full = self.lora_A.detach()
        if group is not None:
            dist.broadcast(full, src=dist.get_global_rank(group, 0), group=group)
        for name, lay, src in (("lora_A", a_lay, full), ("lora_B", b_lay, self.lora_B.detach())):
            local = src.new_empty(local_shape(src.shape, [lay], rank, size))
            for pc in pieces([lay], rank, size):
                local[pc.dst] = src[pc.src]
            setattr(self, name, nn.Parameter(local))
        if group is not None and any(p.kind == "kv" and p.size // p.unit < size for p in b_lay.parts):
            self.lora_B.register_hook(kv_replica_hook(b_lay, group, rank, size))


class LoraAdapter(nn.Module):
    """The adapter's pairs (keyed by Hugging Face module name, dots as ``--``) and the hooks that apply them; its
    ``tp_layouts``/``tp_size``/``tp_group`` are a model's, so ``iter_hf_tensors`` and ``pieces`` read it as one."""

    def __init__(self, spec: LoraSpec, sites: list[Site], *, dtype=None, device=None, tp=(0, 1, None),
                 experts=()):
        super().__init__()
        self.spec, self.sites, self.expert_sites = spec, sites, list(experts)
        self.pairs = nn.ModuleDict({
            _key(s.hf_module): LoraPair(s.in_features, s.rows, spec, dtype, device) for s in sites})
        self.expert_pairs = nn.ModuleDict({
            _key(s.target): lora_experts.ExpertPair(s, spec.rank, spec.scaling, dtype, device) for s in experts})
        self.tp_rank, self.tp_size, self.tp_group = tp
        self._tp_layouts = {}
        for s in sites:
            (a,), (b,) = s.tp_layouts(spec.rank)
            self._tp_layouts[f"pairs.{_key(s.hf_module)}.lora_A"] = [a]
            self._tp_layouts[f"pairs.{_key(s.hf_module)}.lora_B"] = [b]
        for s in self.expert_sites:  # whole (expert LoRA under TP is refused)
            a, b = s.layouts(spec.rank)
            self._tp_layouts[f"expert_pairs.{_key(s.target)}.lora_A"] = a
            self._tp_layouts[f"expert_pairs.{_key(s.target)}.lora_B"] = b
        self.enabled = True
        self._handles = []
        self.base_trainable: list = []  # the base parameters that trained before the adapter froze them
        self.base_changed = False  # the base trained in this run (a LoRA run's SFT warm-up): checkpoints hold it
        self.quantize_pending = False  # --quantize-base nf4 waits for the warm-up that trains the base

    def pair(self, hf_module: str) -> LoraPair:
        return self.pairs[_key(hf_module)]

    def expert_pair_list(self) -> list:
        """``(ExpertSite, ExpertPair)`` of every adapted expert parameter."""
        return [(s, self.expert_pairs[_key(s.target)]) for s in self.expert_sites]

    def shard(self, styles: dict) -> None:
        """Under TP: every pair keeps this rank's shard (``styles``: areno module name -> its TP style)."""
        for s in self.sites:
            lays = self._tp_layouts[f"pairs.{_key(s.hf_module)}.lora_A"] + self._tp_layouts[
                f"pairs.{_key(s.hf_module)}.lora_B"]
            self.pair(s.hf_module).shard(*lays, self.tp_rank, self.tp_size, self.tp_group, styles[s.module])
        for pname, param in self.named_parameters():  # the optimizer counts these once in the grad norm
            param.tp_replicated = not any(lay.sharded for lay in self._tp_layouts[pname])

    def hook(self, model) -> None:
        """Add the deltas to the targeted projections' outputs (one forward hook per areno ``Linear``)."""
        by_module: dict[str, list[Site]] = {}
        for s in self.sites:
            by_module.setdefault(s.module, []).append(s)
        modules = dict(model.named_modules())
        for name, sites in by_module.items():
            linear = modules[name]
            self._handles.append(linear.register_forward_hook(self._hook_for(sorted(sites, key=lambda s: s.offset),
                                                                             linear.weight_shape()[0])))
        lora_experts.hook(model, self, self.expert_pair_list())

    def _hook_for(self, sites: list[Site], out_features: int):
        pairs = [self.pair(s.hf_module) for s in sites]
        spans = [s.span(self.tp_rank, self.tp_size) for s in sites]

        def add_delta(module, args, out):
            if not self.enabled:
                return out
            x = args[0]
            if out.is_contiguous() and all(p.style is None for p in pairs):
                return add_in_place(x, out, module.training)
            if len(sites) == 1 and spans[0][1] == out_features:
                return out + pairs[0](x, module.training).to(out.dtype)
            pieces_, cursor = [], 0
            for (offset, rows), p in zip(spans, pairs):
                if offset > cursor:
                    pieces_.append(out.new_zeros(*out.shape[:-1], offset - cursor))
                pieces_.append(p(x, module.training).to(out.dtype))
                cursor = offset + rows
            if cursor < out_features:
                pieces_.append(out.new_zeros(*out.shape[:-1], out_features - cursor))
            return out + torch.cat(pieces_, dim=-1)

        def add_in_place(x, out, training: bool):
            """Without TP: x cast once for every site (dropout, while training, per site as PEFT's), each delta
            ``B(A(x))`` added into its rows of ``out`` in place with the scaling folded into the add (one rounding
            to ``out``'s dtype instead of two, no zero pieces, no concatenation): ~25 kernels a layer instead of 41
            for an all-linear adapter, and one saved fp32 copy of x per projection instead of one per site."""
            xs = x.reshape(-1, x.shape[-1]).to(pairs[0].lora_A.dtype)
            rows_out = out.view(-1, out_features)
            for (offset, rows), p in zip(spans, pairs):
                xi = torch.nn.functional.dropout(xs, p.dropout, training=True) if training and p.dropout > 0 else xs
                rows_out[:, offset : offset + rows].add_((xi @ p.lora_A.t()) @ p.lora_B.t(), alpha=p.scaling)
            return out

        return add_delta

    def unhook(self, model=None) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if model is not None:
            lora_experts.unhook(model)

    @contextlib.contextmanager
    def disabled(self):
        """The base model for the length of the block (the reference policy)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    # ---- PEFT's files ------------------------------------------------------------------------------------------
    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """PEFT's tensors, whole (gathered over TP: every rank of the group must call it)."""
        return dict(iter_hf_tensors(self))

    def peft_config(self, base: str | None = None) -> dict:
        leaves = sorted({s.hf_module.rsplit(".", 1)[-1] for s in self.sites})
        params = sorted({f"experts.{s.param}" for s in self.expert_sites})
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": self.spec.rank,
                "lora_alpha": self.spec.alpha, "lora_dropout": self.spec.dropout, "target_modules": leaves,
                **({"target_parameters": params} if params else {}),
                "inference_mode": True, "init_lora_weights": True, "rank_pattern": {}, "alpha_pattern": {},
                **UNSUPPORTED_PEFT}

    def save(self, folder, base: str | None = None, *, write: bool = True) -> Path:
        """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's format) into ``folder``; under TP
        every rank of the group calls it (the shards are gathered) and ``write`` says which one writes."""
        from safetensors.torch import save_file

        folder = Path(folder)
        tensors = {k: v.contiguous().cpu() for k, v in self.peft_state_dict().items()}
        if write:
            folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
            (folder / CONFIG_FILE).write_text(json.dumps(self.peft_config(base), indent=2) + "\n")
        return folder

    def load_weights(self, folder, field: str = "--lora-path") -> None:
        """Copy ``folder``'s PEFT tensors into this adapter, this rank's shard of each (every pair must be there,
        shapes equal)."""
        from safetensors.torch import load_file

        path = Path(folder) / WEIGHTS_FILE
        if not path.is_file():
            raise LoraError(field, f"{path} does not exist")
        tensors = load_file(str(path))
        params = dict(self.named_parameters())
        with torch.no_grad():
            for pname, lays in self._tp_layouts.items():
                for pc in pieces(lays, self.tp_rank, self.tp_size):
                    key = pc.hf_name
                    theirs = tensors.get(key, tensors.get(key.replace(".weight", ".default.weight")))
                    if theirs is None:
                        raise LoraError(field, f"{path} has no tensor {key}")
                    if tuple(theirs.shape) != tuple(pc.hf_shape):
                        raise LoraError(field, f"{key} is {tuple(theirs.shape)} in {path}, this model needs "
                                               f"{tuple(pc.hf_shape)}")
                    params[pname][pc.dst].copy_(theirs[pc.src])


def _key(hf_module: str) -> str:
    return hf_module.replace(".", "--")


def read_peft_config(folder, field: str = "--lora-path") -> LoraSpec:
    """A PEFT LoRA adapter folder's spec; options areno does not implement are refused in one line."""
    path = Path(folder).expanduser() / CONFIG_FILE
    if not path.is_file():
        raise LoraError(field, f"{path} does not exist (a PEFT adapter folder holds {CONFIG_FILE})")
    try:
        conf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LoraError(field, f"{path} is not JSON: {e}") from e
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoraError(field, f"{path}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, default in UNSUPPORTED_PEFT.items():
        if conf.get(key, default) not in (default, [], {}):
            raise LoraError(field, f"{path}: {key}={conf[key]!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if conf.get(key):
            raise LoraError(field, f"{path}: {key} (per-module ranks/alphas) is not supported")
    targets = conf.get("target_modules")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        raise LoraError(field, f"{path}: a regular-expression target_modules ({targets!r}) is not supported")
    params = list(conf.get("target_parameters") or [])
    odd = [p for p in params if p.rsplit(".", 1)[-1] not in lora_experts.EXPERT_PARAMS]
    if odd:
        raise LoraError(field, f"{path}: target_parameters {odd[0]!r} is not supported (MoE experts' gate_up_proj and "
                               "down_proj are)")
    if params and targets == ALL_LINEAR:
        raise LoraError(field, f"{path}: all-linear with target_parameters is not supported; list the modules")
    return LoraSpec(int(conf["r"]), float(conf["lora_alpha"]), float(conf.get("lora_dropout") or 0.0),
                    targets if targets == ALL_LINEAR else tuple(targets or ()) + tuple(params))


def attach(model, spec: LoraSpec) -> LoraAdapter:
    """Freeze ``model``'s parameters, build ``spec``'s adapter (fp32 on a half-precision base, as PEFT; the model's
    device) and hook it in; the model keeps it as ``model.lora_adapter`` (not a submodule: its parameters are the
    adapter's own)."""
    if spec.rank <= 0:
        raise LoraError("--lora-rank", f"must be > 0 to build an adapter, got {spec.rank}")
    sites, experts = select_sites(model, spec), select_experts(model, spec)
    tp = (getattr(model, "tp_rank", 0), getattr(model, "tp_size", 1), getattr(model, "tp_group", None))
    if experts and tp[1] > 1:
        raise LoraError("--lora-target-modules", f"{experts[0].target}: LoRA on MoE experts with --tp-size > 1 is "
                                                 "not built yet (the expert adapters are not sharded)")
    if experts and spec.dropout > 0:
        raise LoraError("--lora-dropout", f"{experts[0].target}: LoRA on MoE experts takes no dropout (PEFT's "
                                          "target_parameters adapters have none); use 0")
    modules = dict(model.named_modules())
    styles = {s.module: getattr(modules[s.module], "tp_style", None) for s in sites}
    if tp[1] > 1:
        if spec.dropout > 0:
            raise LoraError("--lora-dropout", "with --tp-size > 1 is not built yet (each rank would draw its own "
                                              "mask over the replicated input)")
        odd = next((m for m, style in styles.items() if style not in (None, "row", "column")), None)
        if odd:
            raise LoraError("--lora-target-modules", f"{odd}: LoRA on a {styles[odd]!r} TP projection is not built")
    w = next(model.parameters())
    # PEFT's autocast_adapter_dtype: a bf16/fp16 base gets fp32 adapter weights (their own optimizer master)
    dtype = torch.float32 if w.dtype in (torch.bfloat16, torch.float16) else w.dtype
    adapter = LoraAdapter(spec, sites, dtype=dtype, device=w.device, tp=tp, experts=experts)
    if tp[1] > 1:
        adapter.shard(styles)
    adapter.base_trainable = [p for p in model.parameters() if p.requires_grad]
    for p in model.parameters():
        p.requires_grad_(False)
    adapter.hook(model)
    object.__setattr__(model, "lora_adapter", adapter)
    return adapter


def adapter_of(model) -> LoraAdapter | None:
    return model.__dict__.get("lora_adapter")
