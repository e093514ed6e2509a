"""The message schema for media, and the one path that turns messages with media into model inputs.

Datasets, agent messages and ``areno serve`` share it. A message's ``content`` is a string or a list of OpenAI-style
parts:

- ``{"type": "text", "text": ...}``
- ``{"type": "image_url", "image_url": {"url": ...}}`` (or ``"image_url": "..."``): a ``data:image/...;base64,``
  URL; a local file path (``/x.png``, ``file:///x.png``, relative to ``base_dir``) only where ``allow_paths``
  (datasets). ``http(s)://`` URLs are refused: areno never fetches.
- ``{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}``, ``{"type": "audio_url", ...}``,
  ``{"type": "video_url", ...}``: parsed and refused by name when the model does not take them.

``MultimodalProcessor.from_pretrained(path)`` reads the checkpoint: its chat template (through the tokenizer), its
image processor (``AutoImageProcessor``: ``preprocessor_config.json``) and its adapter (which modalities it takes,
the media token ids, how many tokens the tower gives per image). ``encode(messages)``:

1. decode every image (PIL; byte and pixel caps in ``MediaLimits``; errors name the part),
2. render the template with one ``{"type": "image"}`` part per image (the template writes one placeholder token),
3. tokenize, run the image processor, and expand each placeholder to the image's ``t*h*w/m^2`` tokens (what
   transformers' Qwen3-VL processor does; its ``AutoProcessor`` also builds a video processor that needs torchvision,
   so areno drives the image processor itself).

Every refusal is a ``MediaError`` (a ``ValueError``) whose message names the modality or the part: callers map it to
exit 2 (datasets) or HTTP 400 (requests).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import torch

PART_MODALITY = {"text": "text", "image_url": "image", "image": "image", "input_audio": "audio",
                 "audio_url": "audio", "video_url": "video", "video": "video"}  # fmt: skip


class MediaError(ValueError):
    """A media part that cannot be used: refused modality, remote URL, undecodable or oversized image."""


@dataclass(frozen=True)
class MediaLimits:
    max_image_bytes: int = 20 * 2**20  # encoded size
    max_image_pixels: int = 50_000_000  # width * height before resizing (PIL's decompression-bomb scale)
    max_images: int = 64  # per prompt


@dataclass
class MultimodalPrompt:
    """Model inputs of one prompt. ``positions``/``rope_delta``: M-RoPE ``[3, T]`` and the decode offset (a token at
    index ``n >= T`` sits at ``n + rope_delta``), ``None`` for a text-only model."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_hashes: list[str] = field(default_factory=list)  # sha256 of each image's pixel rows (prefix-cache keys)
    positions: torch.Tensor | None = None
    rope_delta: int = 0
    image_token_id: int | None = None  # the placeholder id the image tokens carry in ``input_ids``


def media_parts(messages) -> list[tuple[int, str, dict]]:
    """``(message index, modality, part)`` of every non-text part; unknown part types are a ``MediaError``."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_MODALITY:
                raise MediaError(f"message {i}: unknown content part type {kind!r} (accepted: {sorted(PART_MODALITY)})")
            if kind != "text":
                out.append((i, PART_MODALITY[kind], part))
    return out


def _url(part: dict, key: str) -> str:
    value = part.get(key)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise MediaError(f"{key} part without a url (expected {{'type': '{key}', '{key}': {{'url': ...}}}})")
    return url


def read_image_bytes(url: str, *, allow_paths: bool = False, base_dir=None, limits: MediaLimits = MediaLimits()):
    """The encoded bytes behind an ``image_url``: a data URL, or a local file where ``allow_paths``."""
    head = url[:16].lower()
    if head.startswith(("http://", "https://")):
        raise MediaError(f"image_url {url[:60]!r}: remote URLs are not fetched (areno never downloads); send the image "
                         "inline as a data URL (data:image/png;base64,...)")  # fmt: skip
    if head.startswith("data:"):
        meta, sep, payload = url.partition(",")
        if not sep or ";base64" not in meta:
            raise MediaError("image_url: a data URL must be data:image/<type>;base64,<data>")
        if len(payload) * 3 // 4 > limits.max_image_bytes:
            raise MediaError(f"image_url: the image is over the size cap of {limits.max_image_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"image_url: the data URL is not valid base64 ({e})") from None
    if not allow_paths:
        raise MediaError(f"image_url {url[:60]!r}: only data URLs are accepted here (local paths only in datasets)")
    path = Path(url.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise MediaError(f"image_url: no such image file {str(path)!r}")
    if path.stat().st_size > limits.max_image_bytes:
        raise MediaError(f"image_url: {str(path)!r} is over the size cap of {limits.max_image_bytes} bytes")
    return path.read_bytes()


def decode_image(data: bytes, *, limits: MediaLimits = MediaLimits()):
    """Bytes -> an RGB ``PIL.Image`` (fully decoded, so a truncated file fails here), within the pixel cap."""
    from PIL import Image

    if len(data) > limits.max_image_bytes:
        raise MediaError(f"image_url: the image is over the size cap of {limits.max_image_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > limits.max_image_pixels:
            raise MediaError(f"image_url: {image.width}x{image.height} pixels is over the cap of "
                             f"{limits.max_image_pixels} pixels")  # fmt: skip
        image.load()
        return image.convert("RGB")
    except MediaError:
        raise
    except Exception as e:  # PIL raises several types (UnidentifiedImageError, OSError, DecompressionBombError)
        raise MediaError(f"image_url: could not decode the image ({type(e).__name__}: {e})") from None


class MultimodalProcessor:
    """A checkpoint's message -> model-input path (see module doc). ``modalities`` lists what the model takes."""

    def __init__(self, tokenizer, model_config, image_processor=None, *, model_type: str, limits=None):
        self.tokenizer, self.config, self.image_processor = tokenizer, model_config, image_processor
        self.model_type, self.limits = model_type, limits or MediaLimits()
        vision = getattr(model_config, "vision", None)
        self.modalities = {"text"} | ({"image"} if vision is not None and image_processor is not None else set())

    @classmethod
    def from_pretrained(cls, path_or_repo_id, *, limits: MediaLimits | None = None):
        from transformers import AutoConfig

        from areno.models.loader import load_tokenizer, read_config, resolve_model_path
        from areno.models.registry import get_adapter

        path = resolve_model_path(path_or_repo_id)
        model_type = read_config(path).get("model_type")
        cfg = get_adapter(model_type).config_from_hf(AutoConfig.from_pretrained(str(path)))
        image_processor = None
        if getattr(cfg, "vision", None) is not None and (path / "preprocessor_config.json").is_file():
            from transformers import AutoImageProcessor

            image_processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        return cls(load_tokenizer(path), cfg, image_processor, model_type=model_type, limits=limits)

    def check(self, messages) -> list[tuple[int, str, dict]]:
        """The media parts of ``messages``, or a ``MediaError`` naming the first one the model does not take."""
        parts = media_parts(messages)
        for i, modality, part in parts:
            if modality in self.modalities:
                continue
            kind = part["type"]
            if modality == "video" and "image" in self.modalities:
                raise MediaError(f"message {i}: video input ('{kind}' part) is not supported yet for "
                                 f"{self.model_type}; send the frames as image_url parts")  # fmt: skip
            raise MediaError(f"message {i}: the model ({self.model_type}) does not take {modality} input "
                             f"('{kind}' part); it takes {', '.join(sorted(self.modalities))}")  # fmt: skip
        if sum(m == "image" for _, m, _ in parts) > self.limits.max_images:
            raise MediaError(f"more than {self.limits.max_images} images in one prompt")
        return parts

    def encode(self, messages, *, add_generation_prompt: bool = True, allow_paths: bool = False, base_dir=None,
               **template_kwargs) -> MultimodalPrompt:  # fmt: skip
        """Messages (dicts) -> ``MultimodalPrompt`` (images decoded, placeholders expanded, M-RoPE positions)."""
        parts = self.check(messages)
        images = [decode_image(read_image_bytes(_url(p, p["type"]) if p["type"] == "image_url" else _image_of(p),
                                                allow_paths=allow_paths, base_dir=base_dir, limits=self.limits),
                               limits=self.limits) for _, _, p in parts]  # fmt: skip
        rendered = [dict(m, content=[{"type": "image"} if PART_MODALITY.get(p.get("type")) == "image" else p
                                     for p in m["content"]]) if isinstance(m.get("content"), list) else m
                    for m in messages]  # fmt: skip
        text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **template_kwargs)  # fmt: skip
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not images:
            return self._finish(MultimodalPrompt(ids))
        out = self.image_processor(images=images, return_tensors="pt")
        pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
        image_id, merge = self.config.image_token_id, self.config.vision.spatial_merge_size
        slots = [k for k, t in enumerate(ids) if t == image_id]
        if len(slots) != len(images):
            raise MediaError(f"the chat template wrote {len(slots)} image placeholders for {len(images)} images")
        expanded, last = [], 0
        for k, (t, h, w) in zip(slots, grid.tolist()):
            expanded += ids[last:k] + [image_id] * (t * h * w // merge**2)
            last = k + 1
        expanded += ids[last:]
        rows = grid.prod(-1).tolist()
        hashes = [hashlib.sha256(chunk.contiguous().numpy().tobytes()).hexdigest()
                  for chunk in pixel_values.split(rows)]  # fmt: skip
        return self._finish(MultimodalPrompt(expanded, pixel_values, grid, hashes, image_token_id=image_id))

    def _finish(self, prompt: MultimodalPrompt) -> MultimodalPrompt:
        from areno.models.qwen3_vl import Qwen3VLConfig, mrope_positions

        if not isinstance(self.config, Qwen3VLConfig):
            return prompt

        positions, deltas = mrope_positions(torch.tensor(prompt.input_ids), prompt.image_grid_thw,
                                            image_token_id=self.config.image_token_id,
                                            spatial_merge_size=self.config.vision.spatial_merge_size)  # fmt: skip
        prompt.positions, prompt.rope_delta = positions, deltas[0]
        return prompt


def _image_of(part: dict) -> str:
    """``{"type": "image", "image": url}`` (transformers' own spelling) -> the url."""
    value = part.get("image") or part.get("url") or part.get("path")
    if not isinstance(value, str):
        raise MediaError("image part without an image url or path")
    return value


def data_url(data: bytes, mime: str = "image/png") -> str:
    """``data:<mime>;base64,...`` for ``data`` (tests, examples, clients)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"

