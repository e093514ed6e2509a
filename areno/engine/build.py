"""The one build path of a rollout engine for train and serve: device/dtype, EOS ids, EngineConfig, and the engine
session from a checkpoint (model + tokenizer + KV cache) the way serve opens one.

``areno train`` (``rl/rollout/colocated.engine_config``, both rollout modes) and ``areno serve``
(``serve/server.build_app`` through ``build_engine``) build their engines through these functions; only the values
they pass differ (the flags of each command).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from areno.engine.engine import Engine, EngineConfig
from areno.models.loader import default_device


def device_and_dtype(dtype=None, device=None, *, checkpoint_dtype: bool = False) -> tuple[torch.device, object]:
    """``(device, dtype)`` for a run: ``device`` as given, else the current CUDA device or the CPU; ``dtype`` (a name
    such as ``"bfloat16"`` or a ``torch.dtype``) as given, else bfloat16 on CUDA and float32 on the CPU, or with
    ``checkpoint_dtype`` None (the loader then reads the checkpoint's own dtype: ``areno serve``)."""
    device = default_device() if device is None else torch.device(device)
    if isinstance(dtype, str) and dtype:
        return device, getattr(torch, dtype)
    if dtype or checkpoint_dtype:
        return device, dtype or None
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def eos_ids_from_checkpoint(path) -> list[int]:
    """The ``eos_token_id`` entries of a local checkpoint's generation_config.json and config.json."""
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


def eos_token_ids(model_path, tokenizer) -> list[int] | None:
    """The engine's stop ids: a local checkpoint's EOS ids and the tokenizer's; None for a hub id or no path (the
    engine then stops on the tokenizer's EOS)."""
    if not model_path or not Path(str(model_path)).is_dir():
        return None
    ids = set(eos_ids_from_checkpoint(model_path))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def engine_config(model, *, max_running: int = 256, max_model_len: int | None = None, eager_decode: bool = False,
                  decode_steps: int = 1, seed: int = 0, kv_cache_memory: float | None = None,
                  decode_progress_interval_s: float | None = None, block_size: int = 16,
                  record_routing: bool = False, kv_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto",
                  speculative_tokens: int = 0, speculative_disable_by_batch_size=None) -> EngineConfig:
    """The ``EngineConfig`` for ``model`` and a command's values; ``record_routing`` (routing replay) only applies to
    a sparse-MoE model (``model.is_moe``); ``kv_cache_dtype``: --kv-cache-dtype (auto, fp8);
    ``mamba_ssm_cache_dtype``: --mamba-ssm-cache-dtype (auto, float32, bfloat16: the hybrids' delta-rule state
    pool);
    ``speculative_tokens`` > 0: MTP speculative decoding, ``speculative_disable_by_batch_size`` its gate (None:
    auto)."""
    return EngineConfig(
        block_size=block_size, max_running=max_running, max_model_len=max_model_len, eager_decode=eager_decode,
        decode_steps=decode_steps, seed=seed, kv_cache_memory=kv_cache_memory,
        decode_progress_interval_s=decode_progress_interval_s, record_routing=record_routing and model.is_moe,
        kv_cache_dtype=kv_cache_dtype, mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
        speculative_tokens=speculative_tokens, speculative_disable_by_batch_size=speculative_disable_by_batch_size,
    )


def build_engine(model_path, *, model=None, tokenizer=None, tp_size=1, max_running=256, max_model_len=None,
                 eager_decode=False, attn_backend=None, decode_progress_interval_s=None, dtype=None, seed=0,
                 kv_cache_memory=None, block_size=16, device=None, max_loras=0, max_lora_rank=16, lora_modules=None,
                 rollout_dtype="bf16", kv_cache_dtype="auto", speculative_tokens=0,
                 speculative_disable_by_batch_size=None, decode_steps=1, mamba_ssm_cache_dtype="auto"):
    """(Engine, tokenizer) for ``model_path`` (a local folder or a Hugging Face repo id); ``max_loras`` > 0: LoRA
    adapter slots of ``max_lora_rank``, ``lora_modules`` ({name: PEFT folder}) loaded into them (a ``ConfigError``
    naming --lora-modules for one that cannot be served); ``rollout_dtype`` fp8: the linear weights quantised to
    blockwise FP8 and run by the FP8 GEMM (models/fp8_rollout.py); ``kv_cache_dtype`` fp8: the paged KV cache in
    E4M3 with per-token, per-head scales (engine/kv_cache.py; a ``ConfigError`` naming --kv-cache-dtype for MLA);
    ``mamba_ssm_cache_dtype`` bfloat16: a hybrid model's delta-rule state pool in bf16 (auto: the checkpoint's
    ``mamba_ssm_dtype``, else fp32; engine/state_cache.py; a ``ConfigError`` naming --mamba-ssm-cache-dtype for a
    named dtype with a model without recurrent layers);
    ``decode_steps`` > 1: ``Engine.generate`` chains that many decode steps per scheduling round."""
    from areno.distributed.parallel import get_tp_group
    from areno.models import load_model, load_tokenizer

    device, dtype = device_and_dtype(dtype, device, checkpoint_dtype=True)
    if model is None:
        model = load_model(model_path, dtype=dtype, device=device, tp_group=get_tp_group() if tp_size > 1 else None,
                           attn_backend=attn_backend)
    model.eval()
    if rollout_dtype == "fp8":
        from areno.models import fp8_rollout

        fp8_rollout.enable(model)
    if tokenizer is None:
        tokenizer = load_tokenizer(model_path)
    config = engine_config(model, block_size=block_size, max_running=max_running, max_model_len=max_model_len,
                           eager_decode=eager_decode, decode_progress_interval_s=decode_progress_interval_s,
                           decode_steps=decode_steps, seed=seed, kv_cache_memory=kv_cache_memory,
                           kv_cache_dtype=kv_cache_dtype, mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                           speculative_tokens=speculative_tokens,
                           speculative_disable_by_batch_size=speculative_disable_by_batch_size)
    config.max_loras, config.max_lora_rank = max_loras, max_lora_rank
    engine = Engine(model, tokenizer, config, eos_token_ids=eos_token_ids(model_path, tokenizer))
    for name, path in (lora_modules or {}).items():
        try:
            engine.lora.load(name, path)
        except ValueError as exc:
            from areno.config import ConfigError

            raise ConfigError("--lora-modules", str(exc)) from None
    return engine, tokenizer
