"""PPO's critic: a value head on its own copy of the policy backbone (or on ``--critic-ckpt``)."""

from __future__ import annotations

import torch
from torch import nn

from areno.training.batch import pack, per_row
from areno.training.multimodal import media_inputs


class ValueModel(nn.Module):
    """Implements ``areno.models.protocol.TrainedModel``: the facts the trainer reads on what it trains."""

    is_value_model = True  # values(), no log-probs; trained eagerly
    has_routing_bias = False  # no selection bias is moved through the critic
    tp_group = None  # its checkpoint-size estimate counts the critic's own tensors once

    @property
    def config(self):
        """The backbone's architecture."""
        return self.backbone.config

    @property
    def is_multimodal(self) -> bool:
        """Whether the backbone has a media tower (``training.multimodal.media_model`` reaches it there)."""
        return self.backbone.is_multimodal

    def update_routing_bias(self, rate: float, dp_group=None) -> None:
        raise NotImplementedError("the PPO critic has no MoE selection bias (has_routing_bias is False)")

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        p = next(backbone.parameters())
        self.value_head = nn.Linear(hidden_size, 1, dtype=p.dtype, device=p.device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, path, policy, *, dtype, device, tp_group=None):
        from areno.models import load_model

        backbone = load_model(path, dtype=dtype, device=device, tp_group=tp_group) if path else None
        if backbone is None:
            import copy

            backbone = copy.deepcopy(policy)
        backbone.train()
        hidden = backbone.lm_head_weight.shape[-1]
        return cls(backbone, hidden)

    def values(self, input_ids, positions, *, cu_seqlens, max_seqlen, **media) -> torch.Tensor:
        """V(s_t) at every packed position (the state before the token that position predicts), fp32 [T];
        ``media``: a multimodal backbone's image arguments (``areno.training.multimodal.media_inputs``)."""
        hidden = self.backbone(input_ids, positions, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **media)
        return self.value_head(hidden).squeeze(-1).float()

    @torch.no_grad()
    def response_values(self, rows, mini_bs: int) -> list[list[float]]:
        out = []
        device = next(self.parameters()).device
        for i in range(0, len(rows), mini_bs):
            packed = pack(rows[i : i + mini_bs]).to(device)
            v = self.values(packed.input_ids, packed.positions, cu_seqlens=packed.cu_seqlens,
                            max_seqlen=packed.max_seqlen, **media_inputs(self.backbone, packed))
            out.extend(per_row(v, packed))
        return out
