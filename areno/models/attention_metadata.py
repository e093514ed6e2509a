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

A speculative verify runs in decode mode over ``tokens_per_seq`` n > 1 consecutive rows per sequence (each row a
query token attending over its ``seq_lens`` keys, all of the step's K/V stored first, so causal within the step);
recurrent layers step through each sequence's n rows in order, ``state_indices`` then one per sequence; with
``state_steps`` (``areno.engine.spec_graphs.StateSteps``, the engine's: each layer's ``next(kind)`` in layer order)
the short convs keep their states after each of the first n - 1 tokens (a ``[n - 1, rows, ...]`` buffer) and the
delta-rule layers write no state but keep the tokens' inputs for the rollback's replay.

Sliding-window layers (several KV-cache groups, see ``areno.engine.kv_cache``): ``layer_groups`` names each
layer's group; group 0's blocks are ``slot_mapping`` / ``block_table``, group g's (g >= 1)
``group_slot_mappings[g - 1]`` / ``group_block_tables[g - 1]``. A model's layer loop passes ``meta.for_layer(i)``
to layer i (``self`` when there is one group: no extra work).

Routing (sparse-MoE models): ``routing_out`` ``[num_moe_layers, T, k]`` takes each MoE layer's chosen expert ids
(routing capture, written by the layer; a static buffer under CUDA graphs); ``routing_in`` ``[T, num_moe_layers, k]``
gives the ids to use instead of choosing (routing replay; a row of -1 chooses as usual).
"""

from __future__ import annotations

import dataclasses
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
    layer_groups: list[int] | None = None  # per model layer: its KV-cache group (None: one group)
    group_slot_mappings: list[torch.Tensor] | None = None  # groups 1..: slot_mapping of each
    group_block_tables: list[torch.Tensor] | None = None  # groups 1..: block_table of each
    tokens_per_seq: int = 1  # decode: each sequence's new tokens in consecutive rows (a speculative verify)
    state_steps: object = None  # with tokens_per_seq > 1 (hybrids): what the verify keeps for the rollback
    _group_views: list | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def split_rows(self) -> int | None:
        """The row count a decode-mode attention kernel picks its split-K factor for: a speculative verify's
        sequence count (its rows then reduce their keys in the order a plain decode step of those sequences does,
        so greedy speculation follows plain decoding's numbers), else None (the kernel's own rows)."""
        if self.tokens_per_seq == 1 or self.block_table is None:
            return None
        return max(self.block_table.shape[0] // self.tokens_per_seq, 1)

    def for_layer(self, i: int) -> AttentionMetadata:
        """The metadata layer ``i`` attends with: its KV-cache group's slots and block table (made on the first
        call, so fields set before the forward, e.g. ``routing_out``, are shared)."""
        g = 0 if self.layer_groups is None else self.layer_groups[i]
        if g == 0:
            return self
        if self._group_views is None:
            self._group_views = [
                dataclasses.replace(self, slot_mapping=slots, block_table=table, layer_groups=None,
                                    group_slot_mappings=None, group_block_tables=None)
                for slots, table in zip(self.group_slot_mappings, self.group_block_tables)
            ]
        return self._group_views[g - 1]
