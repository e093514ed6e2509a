"""What one forward against the engine's paged KV cache needs to know about its tokens.

The engine builds it per step (static buffers for CUDA-graph decode) and passes it, with the per-layer caches
``[(k_cache, v_cache), ...]`` each ``[num_blocks, block_size, Hkv_local, head_dim]``, to
``model(input_ids, positions, kv_caches=..., attn_metadata=...)``. Every layer first stores its new K/V at
``slot_mapping`` (``block * block_size + offset``; -1 skips, e.g. CUDA-graph padding rows), then:

- decode (``is_prefill=False``): one query token per sequence, ``paged_attention`` over ``seq_lens`` cached keys;
- prefill without cached prefix: varlen ``attention`` over the new tokens (``cu_seqlens_q == cu_seqlens_k``);
- prefill with ``has_prefix`` (some keys already cached, e.g. shared prompt blocks or chunked prefill):
  ``paged_attention`` with ``cu_seqlens_q``, the new tokens being the last ones of each sequence.

Hybrid models (``bailing_hybrid``): a recurrent layer's cache entry is its pair of state pools ``(conv_state [S, D,
W-1], recurrent_state [S, H, K, V])`` instead of K/V blocks; ``state_indices`` names each sequence's slot (-1 skips:
graph padding). A prefill chunk starts from its slot's state when the sequence has tokens before it (``seq_lens`` >
its new tokens), else from zeros, and leaves the state at its end in the slot; a decode step updates it in place.
Its MLA layers' entry is ``(latent_cache,)``, one tensor ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``
(the latent row of each token, same block tables and slots; see ``areno.kernels.attention.mla``), unless the model was
set to the expanded ``(k_cache, v_cache)`` layout.

Routing (sparse-MoE models): ``routing_out`` ``[num_moe_layers, T, k]`` takes each MoE layer's chosen expert ids
(routing capture, written by the layer; a static buffer under CUDA graphs); ``routing_in`` ``[T, num_moe_layers, k]``
gives the ids to use instead of choosing (routing replay; a row of -1 chooses as usual).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # int64/int32 [T]: flat cache slot of each new token, -1 = do not store
    is_prefill: bool
    cu_seqlens_q: torch.Tensor | None = None  # int32 [B+1] over the new tokens
    cu_seqlens_k: torch.Tensor | None = None  # int32 [B+1] over all keys (prefill without prefix: == cu_seqlens_q)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_table: torch.Tensor | None = None  # int32 [B, max_blocks]
    seq_lens: torch.Tensor | None = None  # int32 [B]: cached + new tokens of each sequence
    has_prefix: bool = False
    state_indices: torch.Tensor | None = None  # int32 [B]: recurrent-state slot of each sequence (hybrid models)
    routing_out: torch.Tensor | None = None  # int [num_moe_layers, >= T, k]: chosen expert ids are written here
    routing_in: torch.Tensor | None = None  # int [T, num_moe_layers, k]: expert ids to use (-1 rows: choose)
