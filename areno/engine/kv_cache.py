"""The paged KV cache's layout and size: bytes a block takes, the recurrent-state slots of hybrid models, and the
number of blocks a memory budget buys (the same on every TP rank). See ``model_runner`` for the cache tensor."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from areno.engine.state_cache import RecurrentStates


def kv_cache_layout(model) -> tuple[int, tuple[int, ...]]:
    """(tensors per cache layer, per-token shape): K and V ``[Hkv_local, head_dim]`` unless the model says otherwise
    (``model.kv_cache_layout``: bailing_hybrid's latent MLA cache is one ``[r + d_rope]`` row a token)."""
    if model.kv_cache_layout is not None:
        return model.kv_cache_layout
    return 2, (model.num_kv_heads_local, model.kv_head_dim)


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    layers = len(model.kv_cache_layers)
    n, shape = kv_cache_layout(model)
    return layers * n * block_size * math.prod(shape) * elem


def state_bytes(model, max_running: int, dtype: torch.dtype) -> int:
    """Device bytes of a hybrid model's recurrent-state slots (0 for attention-only models)."""
    shapes = model.recurrent_state_shapes()
    return max_running * RecurrentStates.bytes_per_slot(shapes, dtype) if shapes else 0


def plan_num_blocks(model, *, block_size, dtype, device, kv_cache_memory, max_running, max_model_len) -> int:
    """Blocks for the KV cache: the memory budget, capped by max_running full-length sequences."""
    per_block = kv_bytes_per_block(model, block_size, dtype)
    cap = max_running * math.ceil(max_model_len / block_size) + max_running  # + one spare per sequence
    if kv_cache_memory is None:
        kv_cache_memory = 0.5 if device.type == "cuda" else 256 * 2**20
    if kv_cache_memory <= 1.0:  # a fraction of the free device memory
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * kv_cache_memory)
        else:
            budget = int(kv_cache_memory * 2**30)
    else:
        budget = int(kv_cache_memory)
    budget -= state_bytes(model, max_running, dtype)  # the recurrent-state slots come out of the same budget
    blocks = max(1, min(cap, budget // per_block))
    if dist.is_initialized() and model.tp_group is not None:  # every TP rank the same size
        t = torch.tensor([blocks], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=model.tp_group)
        blocks = int(t.item())
    return blocks
