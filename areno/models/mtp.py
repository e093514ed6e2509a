"""Multi-token-prediction (MTP) layers kept opaque: the tensors a checkpoint stores after the decoder
(``model.layers.{L+j}.*``, Ling 3 and DeepSeek-V3) are loaded as frozen, replicated parameters and saved back
untouched under their Hub names (they are the drafts of speculative decoding; areno does not train or run them)."""

from __future__ import annotations

import torch
from torch import nn

from areno.models.tp import layout


class KeptMTP:
    """Mixin for a ``CausalLM``: call ``init_mtp()`` in ``__init__`` and add ``mtp_layouts()`` to ``hf_layouts``."""

    def init_mtp(self) -> None:
        self.mtp = nn.Module()  # frozen, opaque tensors of the MTP layers, filled at load (see keep_hf_tensor)
        self.mtp_names: list[str] = []

    def keep_hf_tensor(self, hf_name: str) -> bool:
        """True for checkpoint tensors kept opaque: those of the MTP layers after the decoder."""
        if not hf_name.startswith("model.layers."):
            return False
        index = hf_name.split(".")[2]
        return index.isdigit() and int(index) >= self.config.num_layers

    def add_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> str:
        """Hold ``tensor`` as a frozen, replicated parameter saved back under ``hf_name``; returns its name."""
        pname = f"t{len(self.mtp_names)}"
        self.mtp.register_parameter(pname, nn.Parameter(tensor.clone(), requires_grad=False))
        self.mtp_names.append(hf_name)
        return f"mtp.{pname}"

    def mtp_layouts(self) -> dict:
        out = {}
        for j, hf_name in enumerate(self.mtp_names):
            p = getattr(self.mtp, f"t{j}")
            out[f"mtp.t{j}"] = [layout(tuple(p.shape), 0, [(hf_name, p.shape[0])])]
        return out
