"""The paged KV cache's layout and size: its KV-cache groups (sliding-window layers), bytes a block takes, the
recurrent-state slots of hybrid models, and the number of blocks a memory budget buys (the same on every TP rank).
See ``model_runner`` for the cache tensor.

KV-cache groups: the cache layers (``model.kv_cache_layers``) are split by window (``model.layer_windows``, None:
full attention) into groups of at most ``size`` layers each (size = the fewest layers of one window kind, so
OLMo 3's 24 sliding + 8 full layers make 4 groups of 8: one full, three sliding). Every group has its own block
table per sequence, and all groups draw their blocks from one pool: a block holds ``block_size`` tokens of the
``size`` layers of whichever group took it, so a block a sliding group drops (left of its window) serves any group
of any sequence next. A model without windows has one group of all its layers: the layout of before, unchanged.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from areno.engine.state_cache import RecurrentStates


def kv_cache_layout(model) -> tuple[int, tuple[int, ...]]:
    """(tensors per cache layer, per-token shape): K and V ``[Hkv_local, head_dim]`` unless the model says otherwise
    (``model.kv_cache_layout``: bailing_hybrid's latent MLA cache is one ``[r + d_rope]`` row a token)."""
    if model.kv_cache_layout is not None:
        return model.kv_cache_layout
    return 2, (model.num_kv_heads_local, model.kv_head_dim)


class KVGroup(NamedTuple):
    window: int | None  # the sliding window of its layers (None: full attention)
    layers: list[int]  # model layer indices, at most ``group_size`` of them


def kv_groups(model, max_model_len: int | None = None) -> list[KVGroup]:
    """The KV-cache groups of ``model``: full-attention groups first, then by window. A window of at least
    ``max_model_len`` keys never drops a block, so its layers count as full attention."""
    windows = model.layer_windows
    by_window: dict[int | None, list[int]] = {}
    for i in model.kv_cache_layers:
        w = windows[i]
        if w is not None and max_model_len is not None and w >= max_model_len:
            w = None
        by_window.setdefault(w, []).append(i)
    if len(by_window) == 1:
        ((w, layers),) = by_window.items()
        return [KVGroup(w, layers)]
    size = min(map(len, by_window.values()))
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return [KVGroup(w, by_window[w][s : s + size]) for w in order for s in range(0, len(by_window[w]), size)]


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding group holds for a decoding sequence at most: the keys of its window, one partly filled
    block at each end."""
    return -(-window // block_size) + 1


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype, max_model_len: int | None = None,
                       extra_layers: int = 0) -> int:
    """Bytes of one block of the paged cache, ``extra_layers`` cache layers more (the MTP draft's, speculation)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    layers = max(len(g.layers) for g in kv_groups(model, max_model_len)) + extra_layers
    n, shape = kv_cache_layout(model)
    return layers * n * block_size * math.prod(shape) * elem


def state_bytes(model, max_running: int, dtype: torch.dtype) -> int:
    """Device bytes of a hybrid model's recurrent-state slots (0 for attention-only models)."""
    shapes = model.recurrent_state_shapes()
    return max_running * RecurrentStates.bytes_per_slot(shapes, dtype) if shapes else 0


def plan_num_blocks(model, *, block_size, dtype, device, kv_cache_memory, max_running, max_model_len,
                    extra_layers: int = 0) -> int:
    """Blocks for the KV cache: the memory budget, capped by what max_running full-length sequences hold (a
    sliding group: its window's blocks; at least one whole full-length sequence in every group). ``extra_layers``:
    cache layers beside the model's that share the blocks (the MTP draft's with --speculative-tokens)."""
    groups = kv_groups(model, max_model_len)
    per_block = kv_bytes_per_block(model, block_size, dtype, max_model_len, extra_layers)
    full = math.ceil(max_model_len / block_size)
    held = sum(full if g.window is None else min(full, window_blocks(g.window, block_size)) for g in groups)
    cap = max(max_running * held, len(groups) * full) + max_running  # + one spare per sequence
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
