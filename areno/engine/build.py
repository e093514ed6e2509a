"""Build an engine session from a checkpoint: model + tokenizer + KV cache, the way serve and train open one."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from areno.engine.engine import Engine, EngineConfig


def eos_ids_from_checkpoint(path) -> list[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    return sorted(ids)


def build_engine(model_path, *, model=None, tokenizer=None, tp_size=1, max_running=256, max_model_len=None,
                 eager_decode=False, attn_backend=None, decode_progress_interval_s=None, dtype=None, seed=0,
                 kv_cache_memory=None, block_size=16, device=None):
    """(Engine, tokenizer) for ``model_path`` (a local folder or a Hugging Face repo id)."""
    from areno.distributed.parallel import get_tp_group
    from areno.models import load_model, load_tokenizer

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if model is None:
        model = load_model(model_path, dtype=dtype, device=device, tp_group=get_tp_group() if tp_size > 1 else None,
                           attn_backend=attn_backend)
    model.eval()
    if tokenizer is None:
        tokenizer = load_tokenizer(model_path)
    local = Path(str(model_path))
    eos = eos_ids_from_checkpoint(local) if local.is_dir() else None
    if eos is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos = sorted(set(eos) | {tokenizer.eos_token_id})
    config = EngineConfig(
        block_size=block_size, max_running=max_running, max_model_len=max_model_len, eager_decode=eager_decode,
        decode_progress_interval_s=decode_progress_interval_s, seed=seed, kv_cache_memory=kv_cache_memory,
    )
    return Engine(model, tokenizer, config, eos_token_ids=eos), tokenizer
