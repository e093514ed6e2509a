"""Per-sequence recurrent state of a hybrid model's linear-attention layers (KDA), beside the paged KV cache.

Each recurrent layer keeps, per slot, its short-conv state and its delta-rule state (shapes from the model's
``recurrent_state_shapes()``). All layers' pools are one tensor per kind, ``conv [L, S, D, W-1]`` (model dtype) and
``recurrent [L, S, H, K, V]`` (``state_dtype``: fp32, the trainer's precision, or bf16 with
``--mamba-ssm-cache-dtype bfloat16``: half the bytes a decode step reads and writes, the math still fp32 and the
result stored rounded), so forking a sequence (slot a copied to slot b) is one indexed copy of each.
There are ``max_running`` slots; the block manager hands one to each running sequence (``seq.state_slot``) and takes
it back with its blocks. A layer reads and writes its pools through its ``kv_caches`` entry ``(conv[l],
recurrent[l])`` at ``AttentionMetadata.state_indices``; nothing here needs zeroing, since a sequence's first chunk
starts from zeros whatever its slot holds.

The state at the end of a prefix lives only in the slot of the sequence that computed it, so prefix caching across
requests (which reuses K/V blocks of a prefix, not states) is off for these models; the n samples of one prompt
still share its prefill: they fork from the first sample by copying its state after the prompt (and sharing its
blocks).
"""

from __future__ import annotations

import torch

from areno.config import ConfigError
from areno.config.constants import MAMBA_SSM_CACHE_DTYPES

FIELD = "--mamba-ssm-cache-dtype"
STATE_DTYPES = {name: getattr(torch, name) for name in MAMBA_SSM_CACHE_DTYPES if name != "auto"}  # as dtypes


def state_dtype(model, name: str) -> torch.dtype:
    """The recurrent pool's element type of ``--mamba-ssm-cache-dtype`` ``name``: ``auto`` (the default) is the
    checkpoint's ``mamba_ssm_dtype`` where its config names float32 or bfloat16 (as vLLM reads it; Qwen3.5's say
    float32), else float32, the trainer's precision. A ``ConfigError`` naming the flag for an unknown name, or for
    a named dtype with a model that has no recurrent layers (no pool: the flag would do nothing)."""
    if name not in MAMBA_SSM_CACHE_DTYPES:
        raise ConfigError(FIELD, f"must be one of {', '.join(MAMBA_SSM_CACHE_DTYPES)}, got {name!r}")
    if name == "auto":
        return STATE_DTYPES.get(model.config.mamba_ssm_dtype, torch.float32)
    if model.recurrent_state_shapes() is None:
        raise ConfigError(FIELD, f"{name} applies only to hybrid models (recurrent linear-attention layers with a "
                          f"state pool): {type(model).__name__} has none")
    return STATE_DTYPES[name]


class RecurrentStates:
    def __init__(self, shapes: dict, num_slots: int, *, dtype: torch.dtype, device,
                 state_dtype: torch.dtype = torch.float32):
        self.layers = list(shapes["layers"])
        n = len(self.layers)
        self.conv = torch.zeros(n, num_slots, *shapes["conv"], dtype=dtype, device=device)
        self.recurrent = torch.zeros(n, num_slots, *shapes["recurrent"], dtype=state_dtype, device=device)

    @staticmethod
    def bytes_per_slot(shapes: dict, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of one slot over every recurrent layer: the conv state at ``dtype``, the delta-rule state at
        ``state_dtype``."""
        conv, rec = shapes["conv"], shapes["recurrent"]
        return len(shapes["layers"]) * (dtype.itemsize * conv[0] * conv[1] + state_dtype.itemsize * rec[0] * rec[1]
                                        * rec[2])

    def caches(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``{layer index: (conv pool, recurrent pool)}``: the layers' ``kv_caches`` entries."""
        return {layer: (self.conv[j], self.recurrent[j]) for j, layer in enumerate(self.layers)}

    def copy(self, pairs) -> None:
        """Slot ``src``'s state into slot ``dst`` in every layer, for each ``(src, dst)`` (forks)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.conv.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.conv.device)
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]
