"""Checkpoint tensors an adapter holds opaque (MTP layers, a vision tower it does not run): loaded as frozen,
replicated parameters under ``model.mtp`` and saved back untouched under their Hugging Face names."""

from __future__ import annotations

import torch
from torch import nn

from areno.models.tp import layout


class KeptTensors:
    """Mixin for a ``CausalLM``: call ``init_kept()`` in ``__init__``, answer ``keep_hf_tensor(name)``, and add
    ``kept_layouts()`` to ``hf_layouts``; the loader calls ``add_hf_tensor`` for every tensor kept."""

    def init_kept(self) -> None:
        self.mtp = nn.Module()  # frozen, opaque tensors, filled at load
        self.mtp_names: list[str] = []

    def add_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> str:
        """Hold ``tensor`` as a frozen, replicated parameter saved back under ``hf_name``; returns its name."""
        pname = f"t{len(self.mtp_names)}"
        self.mtp.register_parameter(pname, nn.Parameter(tensor.clone(), requires_grad=False))
        self.mtp_names.append(hf_name)
        return f"mtp.{pname}"

    def kept_layouts(self) -> dict:
        out = {}
        for j, hf_name in enumerate(self.mtp_names):
            p = getattr(self.mtp, f"t{j}")
            out[f"mtp.t{j}"] = [layout(tuple(p.shape), 0, [(hf_name, p.shape[0])])]
        return out
