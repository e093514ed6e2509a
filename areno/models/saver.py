"""areno model -> Hugging Face folder: config.json, safetensors shards (+ index), generation config, tokenizer.

Every rank of the model's TP group calls ``save_model``: parameters are gathered one at a time and unstacked into
their Hugging Face tensors (same names, dtypes and values as the checkpoint they came from); only global rank 0
writes. The folder is written beside the target and renamed into place, so readers never see a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from areno.distributed.parallel import is_main_process
from areno.models.tp import pieces

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
# the media processors' configs (multimodal checkpoints): copied from the source folder in every case
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


@torch.no_grad()
def swap_in(tmp: Path, final: Path) -> None:
    """Replace the folder ``final`` by the finished folder ``tmp`` by renames: a reader sees the old folder or the new
    one, never a mix (the old one is renamed aside, then deleted)."""
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)


def iter_hf_tensors(model, *, grads: bool = False):
    """Yield ``(hf_name, full tensor)`` for every Hugging Face tensor of the model (with ``grads``: the gradients of
    its trainable parameters), gathered over TP (a collective: every rank of the group must iterate to the end)."""
    params = dict(model.named_parameters())
    size, group = model.tp_size, model.tp_group
    for pname, lays in model._tp_layouts.items():
        if grads and not params[pname].requires_grad:  # frozen tensors (MTP layers, a router's bias) have none
            continue
        local = params[pname].grad if grads else params[pname]
        if local is None:
            raise ValueError(f"{pname} has no gradient")
        local = local.detach().contiguous()
        if size > 1:
            gathered = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(gathered, local, group=group)
        else:
            gathered = [local]
        full = {}
        for rank in range(size):
            for pc in pieces(lays, rank, size):
                if pc.hf_name not in full:
                    full[pc.hf_name] = torch.empty(pc.hf_shape, dtype=local.dtype, device=local.device)
                full[pc.hf_name][pc.src] = gathered[rank][pc.dst]
        yield from full.items()


def parse_size(size) -> int:
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def _write_weights(model, out: Path | None, max_bytes: int) -> None:
    from safetensors.torch import save_file

    shards, current, current_bytes, total = [], {}, 0, 0
    umask = os.umask(0)
    os.umask(umask)
    file_mode = 0o666 & ~umask

    def flush():
        nonlocal current, current_bytes
        name = f"shard-{len(shards):05d}.safetensors"
        save_file(current, str(out / name), metadata={"format": "pt"})
        os.chmod(out / name, file_mode)  # safetensors creates its files 0600; the rest of the folder follows the umask
        shards.append((name, list(current)))
        current, current_bytes = {}, 0

    for name, tensor in iter_hf_tensors(model):
        if out is None:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if current and current_bytes + nbytes > max_bytes:
            flush()
        current[name] = tensor.cpu()
        current_bytes += nbytes
        total += nbytes
    if out is None:
        return
    if current:
        flush()
    if len(shards) == 1:
        os.rename(out / shards[0][0], out / "model.safetensors")
        return
    weight_map = {}
    for k, (name, keys) in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(out / name, out / final)
        weight_map.update({key: final for key in keys})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_config_and_tokenizer(model, out: Path, tokenizer) -> None:
    config = dict(model.hf_config or {})
    if not config:
        raise ValueError("save_model: the model has no hf_config (load it with areno.models.load_model)")
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for k in keys:
        config[k] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    source = model.source_dir
    for name in ("generation_config.json", *PROCESSOR_FILES):
        if source is not None and (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, out / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    elif source is not None:
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, out / name)


def save_model(model, dir, tokenizer=None, *, max_shard_size="5GB") -> Path:
    """Write ``model`` as a Hugging Face folder at ``dir`` (replaced atomically if it exists); returns ``dir``."""
    final = Path(dir).expanduser().resolve()
    writer = is_main_process()
    tmp = final.parent / f"{final.name}.tmp-{uuid.uuid4().hex[:8]}" if writer else None
    try:
        if writer:
            tmp.mkdir(parents=True)
        _write_weights(model, tmp, parse_size(max_shard_size))
        if writer:
            _write_config_and_tokenizer(model, tmp, tokenizer)
            swap_in(tmp, final)
    except BaseException:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if model.tp_group is not None:
        dist.barrier(group=model.tp_group)
    return final
