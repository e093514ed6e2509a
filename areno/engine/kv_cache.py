"""The paged KV cache's layout and size: its KV-cache groups (sliding-window layers), bytes a block takes, the
recurrent-state slots of hybrid models, and the number of blocks a memory budget buys (the same on every TP rank).
See ``model_runner`` for the cache tensor.

KV-cache groups: the cache layers (``model.kv_cache_layers``) are split by window (``model.layer_windows``, None:
full attention) into groups of at most ``size`` layers each (size = the fewest layers of one window kind, so
OLMo 3's 24 sliding + 8 full layers make 4 groups of 8: one full, three sliding). Every group has its own block
table per sequence, and all groups draw their blocks from one pool: a block holds ``block_size`` tokens of the
``size`` layers of whichever group took it, so a block a sliding group drops (left of its window) serves any group
of any sequence next. A model without windows has one group of all its layers: the layout of before, unchanged.

FP8 cache (``--kv-cache-dtype fp8``, ``cache_dtype`` here): K and V held as float8_e4m3fn, each token's KV-head
vector with its own fp32 scale (``k_scale``/``v_scale`` of kernels/attention/paged.py), so a token of a layer takes
``2 * Hkv * (D + 4)`` bytes instead of ``2 * Hkv * D * 2`` in bf16: 1.94x the tokens at D = 128 in one budget.
The hybrids' recurrent states are not in the KV cache (their pools' dtypes: ``state_cache``, --mamba-ssm-cache-dtype;
their bytes come out of the same budget, ``state_bytes``); ``check_kv_cache_dtype`` refuses fp8 for a model with a
latent-attention layer (MLA) or a cache layout of its own without ``kv_scale_heads`` (Gemma 4 has them: its flat
per-layer rows get ``[.., kv_scale_heads]`` scales, each layer viewing its first Hkv).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from areno.config import ConfigError
from areno.engine.state_cache import RecurrentStates
from areno.kernels.fp8 import FP8
from areno.models.mla import LatentAttention

FIELD = "--kv-cache-dtype"


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The K/V element type of ``--kv-cache-dtype`` (auto: the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8
    raise ConfigError(FIELD, f"must be one of auto, fp8, got {kv_cache_dtype!r}")


def check_kv_cache_dtype(model, kv_cache_dtype: str) -> None:
    """Refuse fp8 where it is not built: MLA models (DeepSeek-V3, Kimi Linear, Ling 3's latent cache)."""
    if kv_cache_dtype == "auto":
        return
    cache_dtype(kv_cache_dtype, torch.float32)
    if any(isinstance(m, LatentAttention) for m in model.modules()):
        raise ConfigError(FIELD, f"fp8 with an MLA model ({type(model).__name__}: latent attention) is not built yet "
                          "(its latent cache and the mla_decode kernel read the model's dtype)")
    if kv_scale_shape(model) is None:
        raise ConfigError(FIELD, f"fp8 with {type(model).__name__}'s own cache layout {model.kv_cache_layout} is not "
                          "built yet (the model names no per-head scale layout, kv_scale_heads)")


def kv_scale_shape(model) -> tuple[int, ...] | None:
    """Per-token shape of an FP8 cache tensor's scales: ``(Hkv,)`` for the K/V layout; a model with a layout of its
    own says ``kv_scale_heads`` (Gemma 4: its widest layer's Hkv, each layer viewing the first of them); None
    where no scale layout is built."""
    if model.kv_cache_layout is None:
        return (model.num_kv_heads_local,)
    heads = getattr(model, "kv_scale_heads", None)
    return None if heads is None else (heads,)


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
    """Bytes of one block over its group's layers (``extra_layers`` cache layers more: the MTP draft's with
    speculation); an FP8 ``dtype`` adds each (token, KV head) row's fp32 scale."""
    elem = torch.tensor([], dtype=dtype).element_size()
    layers = max(len(g.layers) for g in kv_groups(model, max_model_len)) + extra_layers
    n, shape = kv_cache_layout(model)
    scales = 4 * math.prod(kv_scale_shape(model)) if dtype == FP8 else 0
    return layers * n * block_size * (math.prod(shape) * elem + scales)


def state_bytes(model, max_running: int, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
    """Device bytes of a hybrid model's recurrent-state slots (0 for attention-only models): conv states at the
    model's ``dtype``, delta-rule states at ``state_dtype`` (--mamba-ssm-cache-dtype)."""
    shapes = model.recurrent_state_shapes()
    return max_running * RecurrentStates.bytes_per_slot(shapes, dtype, state_dtype) if shapes else 0


def kv_budget(device, kv_cache_memory) -> int:
    """Device bytes of ``--kv-cache-memory`` (None: half the free GPU memory, 256 MiB on the CPU; <= 1: that fraction
    of the free device memory, of 1 GiB on the CPU; else bytes): the KV cache's, with what shares it."""
    if kv_cache_memory is None:
        kv_cache_memory = 0.5 if device.type == "cuda" else 256 * 2**20
    if kv_cache_memory > 1.0:
        return int(kv_cache_memory)
    if device.type == "cuda":  # a fraction of the free device memory
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * kv_cache_memory)
    return int(kv_cache_memory * 2**30)


def plan_num_blocks(model, *, block_size, dtype, device, kv_cache_memory, max_running, max_model_len,
                    kv_dtype=None, extra_layers: int = 0, reserved: int = 0,
                    state_dtype: torch.dtype = torch.float32) -> int:
    """Blocks for the KV cache: the memory budget, capped by what max_running full-length sequences hold (a
    sliding group: its window's blocks; at least one whole full-length sequence in every group). ``dtype``: the
    model's (the conv states); ``kv_dtype``: the K/V elements' (default ``dtype``; FP8 counts its scales);
    ``state_dtype``: the delta-rule states' (--mamba-ssm-cache-dtype);
    ``extra_layers``: cache layers beside the model's sharing the blocks (the MTP draft's, speculation);
    ``reserved``: device bytes allocated beside the cache out of the same budget (speculation's, ``spec_budget``)."""
    groups = kv_groups(model, max_model_len)
    per_block = kv_bytes_per_block(model, block_size, kv_dtype or dtype, max_model_len, extra_layers)
    full = math.ceil(max_model_len / block_size)
    held = sum(full if g.window is None else min(full, window_blocks(g.window, block_size)) for g in groups)
    cap = max(max_running * held, len(groups) * full) + max_running  # + one spare per sequence
    budget = kv_budget(device, kv_cache_memory)
    states = state_bytes(model, max_running, dtype, state_dtype)  # the recurrent-state slots: out of the same budget
    if budget - states - reserved < per_block:
        raise ConfigError(
            "--kv-cache-memory", f"({budget:,} bytes) holds no KV block ({per_block:,} bytes) after the "
            f"recurrent-state slots of {max_running} sequences ({states:,} bytes) and speculation's reserve "
            f"({reserved:,} bytes): raise it or lower --max-running-prompts"
        )
    blocks = min(cap, (budget - states - reserved) // per_block)
    if dist.is_initialized() and model.tp_group is not None:  # every TP rank the same size
        t = torch.tensor([blocks], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=model.tp_group)
        blocks = int(t.item())
    return blocks
