"""The model contract: what the engine and the trainer may call and read on a model, as ``typing.Protocol`` classes.

``TrainedModel`` is what the trainer and the training loop read on anything they train (every adapter and the PPO
critic, ``areno.rl.critic.ValueModel``); ``ModelProtocol`` adds what the rollout engine, the loader/saver and the
trainer's fused paths read on an adapter. Capability facts are declared attributes with defaults on
``areno.models.base.CausalLM`` (a new family overrides the ones that differ); callers read them, never probe for
methods with ``hasattr``. Both protocols are ``runtime_checkable``: ``tests/models/test_protocol.py`` checks every
registered adapter with ``isinstance`` and its capability values.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from areno.models.model_config import ModelConfig


@runtime_checkable
class TrainedModel(Protocol):
    """What the trainer and the loop read on any model they train (a policy adapter or the PPO critic)."""

    config: ModelConfig  # the architecture (the critic: its backbone's)
    is_value_model: bool  # the PPO critic: ``values(...)`` per position, no log-probs, trained eagerly
    is_multimodal: bool  # a vision tower: encode_images, freeze_media, tower/projector_parameters
    has_routing_bias: bool  # ``update_routing_bias`` moves an MoE selection bias (Ling 3 / bailing_hybrid)
    tp_group: Any  # the tensor-parallel group the weights are sharded over (None: not sharded)

    def update_routing_bias(self, rate: float, dp_group=None) -> None: ...


@runtime_checkable
class ModelProtocol(TrainedModel, Protocol):
    """What the engine, the loader/saver and the trainer may call and read on a causal-LM adapter."""

    attn_backend: str  # "flash" or "native" (--attn-backend)
    tie_word_embeddings: bool  # the LM head is the embedding
    num_moe_layers: int  # sparse-MoE layers: the rows of routing capture/replay tensors
    moe_top_k: int  # experts per token in those layers (0: dense)
    is_moe: bool  # num_moe_layers > 0: the engine can capture routing, the trainer replay it
    is_hybrid: bool  # recurrent layers (``recurrent_state_shapes()`` is not None): per-sequence state slots
    activation_checkpointing: bool  # set by ``set_activation_checkpointing``
    engine_support: str | None  # why the rollout engine cannot run this family (None: it can)
    hf_config: dict | None  # the checkpoint's config.json (set by the loader; the saver writes it back)
    source_dir: Any  # the folder the weights came from (the saver copies its generation/processor files)
    # sizes the engine allocates the paged KV cache with
    num_layers: int
    head_dim: int
    num_kv_heads_local: int
    kv_head_dim: int
    kv_cache_layers: list[int]
    kv_cache_layout: tuple | None  # (tensors per layer, per-token shape); None: K and V [Hkv_local, kv_head_dim]
    layer_windows: list  # per layer: its sliding window in keys, None for full attention (KV-cache groups)
    logit_softcap: float | None  # logits are cap * tanh(logits / cap) (Gemma 4); None: plain

    def forward(self, input_ids, positions, cu_seqlens=None, max_seqlen=None, *, kv_caches=None,
                attn_metadata=None, routed_experts=None) -> torch.Tensor: ...

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def token_logprobs(self, hidden, targets, *, temperature=1.0, return_entropy=False, chunk_size=None): ...

    def recurrent_state_shapes(self) -> dict | None: ...

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple: ...

    def init_buffers(self, device=None) -> None: ...

    def set_activation_checkpointing(self, enabled: bool = True) -> None: ...

    def after_weight_update(self) -> None: ...

    def encode_images(self, pixel_values, image_grid_thw): ...

    def freeze_media(self, *, tower: bool = True, projector: bool = True) -> None: ...

    def tower_parameters(self) -> list: ...

    def projector_parameters(self) -> list: ...

    def hf_layouts(self) -> dict: ...

    def keep_hf_tensor(self, hf_name: str) -> bool: ...
