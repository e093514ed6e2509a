"""Multi-token-prediction (MTP) layers kept opaque: the tensors a checkpoint stores after the decoder
(``model.layers.{L+j}.*``, Ling 3 and DeepSeek-V3) are loaded as frozen, replicated parameters and saved back
untouched under their Hub names (they are the drafts of speculative decoding; areno does not train or run them)."""

from __future__ import annotations

import torch

from areno.models.layers import KeptTensors


class KeptMTP:
    """Mixin for a ``CausalLM``: call ``init_mtp()`` in ``__init__`` and add ``mtp_layouts()`` to ``hf_layouts``."""

    def init_mtp(self) -> None:
        self.mtp = KeptTensors()  # frozen, opaque tensors of the MTP layers, filled at load (see keep_hf_tensor)

    @property
    def mtp_names(self) -> list[str]:
        return self.mtp.names

    def keep_hf_tensor(self, hf_name: str) -> bool:
        """True for checkpoint tensors kept opaque: those of the MTP layers after the decoder."""
        if not hf_name.startswith("model.layers."):
            return False
        index = hf_name.split(".")[2]
        return index.isdigit() and int(index) >= self.config.num_layers

    def add_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> str:
        """Hold ``tensor`` as a frozen, replicated parameter saved back under ``hf_name``; returns its name."""
        return f"mtp.{self.mtp.add(hf_name, tensor)}"

    def mtp_layouts(self) -> dict:
        return self.mtp.layouts("mtp")
