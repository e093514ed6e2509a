"""LoRA on MoE routed experts: PEFT's ``target_parameters`` adapters of transformers' fused ``experts.gate_up_proj``
/ ``experts.down_proj`` (one (A, B) per expert), applied unmerged around areno's expert GEMMs.

PEFT's ParamWrapper holds an ``[E, out, in]`` expert parameter's adapter as two 2-D tensors: ``lora_A [E*r, in]``
(expert-major rows: expert e's A is rows ``e*r : (e+1)*r``) and ``lora_B [out, r*E]`` (rank-major columns: expert e's
B is columns ``e::E``), scaling ``alpha / r``; areno keeps exactly those tensors (so files, policy sync and loading
read them as any other adapter tensor) and ``fused_moe_lora`` slices them per expert. transformers' gate_up rows are
gate then up, as areno's ``w13``. Names: ``base_model.model.<layer>.mlp.experts.lora_A.weight``; when both
parameters of one experts module are adapted PEFT nests the wrappers in parameter order, gate_up inside down, so
gate_up's tensors sit under ``experts.base_layer.``. PEFT's ParamWrapper has no dropout (refused here too).

``--lora-target-modules`` names them as PEFT's ``target_parameters`` do (``experts.gate_up_proj``,
``experts.down_proj``, a dotted suffix matches; ``experts`` names both); ``all-linear`` leaves them out (areno's
all-linear: the linear modules; PEFT with transformers 5 maps its all-linear on a converted MoE to the experts at rank
2r plus the router, which areno does not adapt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from areno.models.qwen3_moe import Experts
from areno.models.tp import one_layout

EXPERT_PARAMS = {"gate_up_proj": "w13", "down_proj": "w2"}  # PEFT's (transformers') parameter -> areno's
PREFIX = "base_model.model."


@dataclass
class ExpertSite:
    """One adapted expert parameter: ``module`` (areno: ``layers.0.mlp.experts``), ``hf_module`` (transformers':
    ``model.layers.0.mlp.experts``), ``param`` (``gate_up_proj`` or ``down_proj``) of ``[E, out, in]``."""

    module: str
    hf_module: str
    param: str
    num_experts: int
    out_features: int
    in_features: int
    nested: bool = False  # gate_up inside down's wrapper (both adapted): PEFT's names gain ``base_layer.``

    @property
    def target(self) -> str:
        return f"{self.hf_module}.{self.param}"

    def tensor_name(self, kind: str) -> str:
        return f"{PREFIX}{self.hf_module}.{'base_layer.' if self.nested else ''}{kind}.weight"

    def layouts(self, r: int) -> tuple[list, list]:
        return (one_layout(self.tensor_name("lora_A"), r * self.num_experts, self.in_features),
                one_layout(self.tensor_name("lora_B"), self.out_features, r * self.num_experts))


def expert_sites(model, peft_module=lambda model, name: name) -> list[ExpertSite]:
    """Both parameters of every routed-experts module (``qwen3_moe.Experts``: Qwen3-MoE, Qwen3.5-MoE, the
    sigmoid-routed families, Gemma 4), under transformers' module names (``peft_module`` maps renamed ones)."""
    layouts = model.hf_layouts()
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        hf = layouts[f"{name}.w13"][0].parts[0].hf_name
        hf_module = peft_module(model, hf[: hf.index(".experts.")] + ".experts")
        for param, attr in EXPERT_PARAMS.items():
            e, o, i = getattr(module, attr).shape
            out.append(ExpertSite(name, hf_module, param, e, o, i))
    return out


def matches(site: ExpertSite, target: str) -> bool:
    """PEFT's rule for ``target_parameters`` (the parameter's full name or a dotted suffix) where the name holds
    ``experts`` (a bare ``down_proj`` stays a linear module's name); ``experts`` (or a dotted name ending in it) names
    both of a module's parameters."""
    names = (site.target, site.hf_module)
    return "experts" in target.split(".") and any(n == target or n.endswith("." + target) for n in names)


def select(model, targets, peft_module) -> list[ExpertSite]:
    """The expert parameters ``targets`` name, nested as PEFT nests them."""
    chosen = [s for s in expert_sites(model, peft_module) if any(matches(s, t) for t in targets)]
    both = {s.hf_module for s in chosen if s.param == "down_proj"}
    for s in chosen:
        s.nested = s.param == "gate_up_proj" and s.hf_module in both
    return chosen


class ExpertPair(nn.Module):
    """PEFT's ``lora_A [E*r, in]`` / ``lora_B [out, r*E]`` of one expert parameter, initialised as PEFT does
    (A kaiming-uniform with a = sqrt 5 over ``in``, B zeros)."""

    def __init__(self, site: ExpertSite, rank: int, scaling: float, dtype=None, device=None):
        super().__init__()
        e = site.num_experts
        self.lora_A = nn.Parameter(torch.empty(e * rank, site.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(site.out_features, rank * e, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.num_experts, self.rank, self.scaling = e, rank, scaling

    def factors(self) -> tuple:
        return self.lora_A, self.lora_B, self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``[E, out, in]``: B_e A_e * scaling (what merging adds to the stacked weight)."""
        e, r = self.num_experts, self.rank
        a = self.lora_A.view(e, r, -1)
        b = self.lora_B.view(self.lora_B.shape[0], r, e).permute(2, 0, 1)
        return torch.bmm(b, a) * self.scaling


class ExpertLora:
    """What an ``Experts`` module's ``lora`` holds: its adapter's pairs (gate_up, down; either may be None),
    applied while the adapter is on."""

    def __init__(self, adapter, gate_up: ExpertPair | None, down: ExpertPair | None):
        self.adapter, self.gate_up, self.down = adapter, gate_up, down

    def factors(self):
        if not self.adapter.enabled:
            return None
        return tuple(None if p is None else p.factors() for p in (self.gate_up, self.down))


def hook(model, adapter, pairs: list) -> None:
    """Give each adapted ``Experts`` module its pairs (``pairs``: ``(ExpertSite, ExpertPair)``)."""
    modules = dict(model.named_modules())
    by_module: dict[str, dict] = {}
    for site, pair in pairs:
        by_module.setdefault(site.module, {})[site.param] = pair
    for name, held in by_module.items():
        modules[name].lora = ExpertLora(adapter, held.get("gate_up_proj"), held.get("down_proj"))


def unhook(model) -> None:
    for m in model.modules():
        if isinstance(m, Experts):
            m.lora = None


@torch.no_grad()
def merge(model, pairs: list) -> dict:
    """Add each pair's delta into its expert weight (in place); returns the replaced weights to restore."""
    modules = dict(model.named_modules())
    kept = {}
    for site, pair in pairs:
        w = getattr(modules[site.module], EXPERT_PARAMS[site.param])
        kept[(site.module, site.param)] = w.detach().clone()
        w.copy_((w.float() + pair.delta_weight().float()).to(w.dtype))
    return kept


@torch.no_grad()
def restore(model, kept: dict) -> None:
    modules = dict(model.named_modules())
    for (module, param), w in kept.items():
        getattr(modules[module], EXPERT_PARAMS[param]).copy_(w)
