"""The training side of multimodal policies: frozen or trainable towers and projectors, their optimizer groups and
learning-rate schedules, dataset prompts with images, and a packed batch's images as forward arguments.

- Frozen by default: ``freeze`` calls the adapter's ``freeze_media`` (no gradients, eval mode, so no optimizer
  state, and split mode never streams them). ``--unfreeze-mm-tower`` / ``--unfreeze-mm-projector`` keep a part
  trainable as its own optimizer group (``mm_tower``, ``mm_projector``) with its own schedule: peak
  ``--mm-*-lr`` (default ``--lr``), final ``--mm-*-min-lr`` (default ``--min-lr``, capped at the peak), length
  ``--mm-*-lr-steps`` optimizer updates (default: the run's), style ``--mm-*-lr-style`` (default
  ``--lr-decay-style``), and ``--warmup-steps`` like the main group. The loop logs their rates as ``lr_mm_*``.
- On a model without a tower (no ``freeze_media``) any of these flags exits 2 naming it (``check_flags``).
- ``DatasetMedia``: dataset prompts whose messages hold media parts go through the checkpoint's
  ``MultimodalProcessor`` (the path serving and rollout use), with local image paths allowed, relative to the
  dataset file; a refused or broken image is a ``DatasetError`` naming the dataset and the row (exit 2).
- ``media_inputs``: the forward's image arguments for a packed batch. With the tower and projector frozen, every
  distinct image of the batch (by content hash) is encoded once without gradients and its embeddings shared by the
  rows that show it (the n samples of a prompt, DPO's pairs).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from areno.config import ConfigError, flag_name

GROUPS = ("mm_tower", "mm_projector")
FLAGS = ("unfreeze_mm_tower", "unfreeze_mm_projector", "mm_tower_lr", "mm_tower_min_lr", "mm_tower_lr_steps",
         "mm_tower_lr_style", "mm_projector_lr", "mm_projector_min_lr", "mm_projector_lr_steps",
         "mm_projector_lr_style")  # fmt: skip


def media_limits(cfg):
    """``MediaLimits`` from ``--max-image-bytes``, ``--max-image-pixels``, ``--max-images-per-prompt``."""
    from areno.models.multimodal import MediaLimits

    return MediaLimits(max_image_bytes=cfg.max_image_bytes, max_image_pixels=cfg.max_image_pixels,
                       max_images=cfg.max_images_per_prompt)


def media_model(model):
    """The model holding the tower: the policy itself, or a PPO critic's backbone."""
    return model.backbone if model.is_value_model else model


def check_flags(cfg, model) -> None:
    """Exit 2 (``ConfigError``) naming the first multimodal flag given for a model without a tower."""
    if media_model(model).is_multimodal:
        return
    defaults = {f.name: f.default for f in fields(cfg)}
    for name in FLAGS:
        if getattr(cfg, name) != defaults[name]:
            kind = model.config.model_type
            raise ConfigError(flag_name(name), f"applies to multimodal models only (a vision or audio tower); the "
                              f"{kind} checkpoint {cfg.ckpt!r} has none")


def freeze(model, cfg) -> None:
    """Freeze the tower and the projector unless ``--unfreeze-mm-tower`` / ``--unfreeze-mm-projector``."""
    inner = media_model(model)
    if inner.is_multimodal:
        inner.freeze_media(tower=not cfg.unfreeze_mm_tower, projector=not cfg.unfreeze_mm_projector)


def optimizer_params(model) -> list:
    """The trainable parameters for ``MasterAdamW``: the unfrozen tower and projector as named groups."""
    inner = media_model(model)
    named = {}
    if inner.is_multimodal:
        named = {"mm_tower": inner.tower_parameters(), "mm_projector": inner.projector_parameters()}
    grouped = {id(p): name for name, ps in named.items() for p in ps}
    out = [p for p in model.parameters() if p.requires_grad and id(p) not in grouped]
    for name, ps in named.items():
        trainable = [p for p in ps if p.requires_grad]
        if trainable:
            out.append({"name": name, "params": trainable})
    return out


def group_schedules(cfg, names, *, lr: float, total_updates: int) -> dict:
    """An ``LRSchedule`` per optimizer group in ``names`` (``mm_tower``, ``mm_projector``), from the ``--mm-*``
    flags; ``lr`` is the phase's main peak (``--lr``, ``--sft-warmup-lr``), the default peak of a group."""
    from areno.training.schedule import LRSchedule

    out = {}
    for name in names:
        peak = getattr(cfg, f"{name}_lr")
        peak = lr if peak is None else peak
        low = getattr(cfg, f"{name}_min_lr")
        low = min(cfg.min_lr, peak) if low is None else low
        out[name] = LRSchedule(peak, min_lr=low, warmup_steps=cfg.warmup_steps,
                               total_steps=getattr(cfg, f"{name}_lr_steps") or total_updates,
                               style=getattr(cfg, f"{name}_lr_style") or cfg.lr_decay_style)  # fmt: skip
    return out


def media_inputs(model, packed) -> dict:
    """The forward's keyword arguments for ``packed``'s images (none for a text batch)."""
    if packed.pixel_values is None:
        return {}
    frozen = not any(p.requires_grad for p in (*model.tower_parameters(), *model.projector_parameters()))
    if not frozen:
        return {"pixel_values": packed.pixel_values, "image_grid_thw": packed.image_grid_thw,
                "image_rows": packed.image_rows}
    grid = packed.image_grid_thw
    merge = model.config.vision.spatial_merge_size
    first: dict[str, int] = {}
    for i, h in enumerate(packed.image_hashes):
        first.setdefault(h, i)
    unique = sorted(first.values())
    patches = grid.prod(-1).tolist()
    starts = [0]
    for n in patches:
        starts.append(starts[-1] + n)
    pixels = torch.cat([packed.pixel_values[starts[i] : starts[i + 1]] for i in unique])
    with torch.no_grad():
        embeds, deepstack = model.encode_images(pixels, grid[unique])
    # token rows of each distinct image in the encoded batch, then every image (in order) picks its own
    tokens = [n // merge**2 for n in patches]
    at, offset = {}, 0
    for i in unique:
        at[i] = offset
        offset += tokens[i]
    pick = torch.cat([torch.arange(at[first[h]], at[first[h]] + tokens[i]) for i, h in enumerate(packed.image_hashes)])
    pick = pick.to(embeds.device)
    return {"image_embeds": (embeds.index_select(0, pick), deepstack.index_select(1, pick)),
            "image_rows": packed.image_rows}


class DatasetMedia:
    """Dataset prompts with media parts -> ``MultimodalPrompt`` through the checkpoint's processor (see module doc).

    Encoded prompts are kept while they fit in ``cache_bytes`` (pixel rows), re-encoded on demand beyond it."""

    def __init__(self, ckpt, dataset_path, *, limits=None, cache_bytes: int = 2**30):
        self.ckpt, self.limits = ckpt, limits
        local = Path(str(dataset_path)).expanduser() if dataset_path else None
        self.base_dir = None if local is None or not local.exists() else (local if local.is_dir() else local.parent)
        self.where = str(dataset_path) if dataset_path else "the dataset"
        self._processor = None
        self._cache: dict[int, object] = {}
        self._cache_left = cache_bytes

    @staticmethod
    def has_media(prompt) -> bool:
        return isinstance(prompt, list) and any(
            isinstance(m, dict) and isinstance(m.get("content"), list)
            and any(isinstance(p, dict) and p.get("type") != "text" for p in m["content"]) for m in prompt)

    @property
    def processor(self):
        if self._processor is None:
            from areno.models.multimodal import MultimodalProcessor

            self._processor = MultimodalProcessor.from_pretrained(self.ckpt, limits=self.limits)
        return self._processor

    def encode(self, prompt, index: int | None = None):
        """The ``MultimodalPrompt`` of a row's ``prompt`` (chat messages); ``index``: the row's place in the dataset
        (errors name it; the cache's key)."""
        key = index
        if key is not None and key in self._cache:
            return self._cache[key]
        from areno.models.multimodal import MediaError
        from areno.training.data import FLAG, DatasetError

        try:
            out = self.processor.encode(prompt, add_generation_prompt=True, allow_paths=True,
                                        base_dir=self.base_dir)
        except MediaError as e:
            raise DatasetError(FLAG, f"{self.where} row {'?' if index is None else index}: {e}") from None
        size = 0 if out.pixel_values is None else out.pixel_values.numel() * out.pixel_values.element_size()
        if key is not None and size <= self._cache_left:
            self._cache[key] = out
            self._cache_left -= size
        return out

    def forget(self, index: int | None) -> None:
        """Drop the cached encoding of the row at ``index`` (a row the loop does not keep)."""
        out = self._cache.pop(index, None)
        if out is not None and out.pixel_values is not None:
            self._cache_left += out.pixel_values.numel() * out.pixel_values.element_size()
