"""The tiny random Qwen3-VL checkpoint: config, weights under the Hub's tensor names, tokenizer and processor files.

``make_tiny_checkpoint(path, "qwen3_vl", seed, **overrides)`` lands here. Overrides are top-level config fields
(``tie_word_embeddings``, token ids) or the nested dicts ``text_config={...}`` / ``vision_config={...}``, merged
into the defaults. The folder has what a Hub Qwen3-VL folder has:

- ``config.json`` through ``transformers.Qwen3VLConfig`` (text rope written in both spellings, as in checkpoints.py);
- ``model.safetensors``: ``model.visual.*``, ``model.language_model.*``, ``lm_head.weight`` (unless tied), drawn
  like the text families (N(0, 0.1), norm scales 1 + N(0, 0.05)) in the fixed order of ``vl_weight_shapes``;
- the tiny BPE tokenizer plus the vision special tokens (``<|vision_start|>`` ... ``<|video_pad|>``, ids after the
  tokenizer's own) and a chat template that renders an image part as
  ``<|vision_start|><|image_pad|><|vision_end|>`` (one pad the processor expands);
- ``preprocessor_config.json`` (``Qwen2VLImageProcessor``: patch 4, merge 2, so 8-pixel steps, 256..4096 pixels)
  and ``video_preprocessor_config.json`` (``Qwen3VLVideoProcessor``), read by ``AutoImageProcessor`` /
  ``AutoProcessor``. transformers' Qwen3-VL ``AutoProcessor`` also builds the video processor, which needs
  torchvision; ``AutoImageProcessor`` needs only PIL.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import areno.testing.tokenizer as tiny_tokenizer
from areno.testing.shapes import weight_shapes

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
VL_VOCAB_SIZE = tiny_tokenizer.VOCAB_SIZE + len(VISION_TOKENS)
PATCH, TEMPORAL_PATCH, MERGE = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 256, 4096
IMAGE_MEAN = IMAGE_STD = [0.5, 0.5, 0.5]

_RENDER = "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
_RENDER_VL = (
    "{%- if part.type == 'text' -%}{{- part.text -}}"
    "{%- elif part.type in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
)
assert _RENDER in tiny_tokenizer.CHAT_TEMPLATE
VL_CHAT_TEMPLATE = tiny_tokenizer.CHAT_TEMPLATE.replace(_RENDER, _RENDER_VL)


def vision_token_id(token: str) -> int:
    return tiny_tokenizer.VOCAB_SIZE + VISION_TOKENS.index(token)


def _defaults() -> dict:
    text = dict(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
        attention_bias=False, attention_dropout=0.0, initializer_range=0.1, use_cache=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True),
        bos_token_id=tiny_tokenizer.token_id(tiny_tokenizer.BOS_TOKEN),
        eos_token_id=tiny_tokenizer.token_id(tiny_tokenizer.EOS_TOKEN),
        pad_token_id=tiny_tokenizer.token_id(tiny_tokenizer.PAD_TOKEN),
    )  # fmt: skip
    vision = dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=PATCH,
        temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE, out_hidden_size=64, num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh", initializer_range=0.1,
    )  # fmt: skip
    return dict(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=vision_token_id("<|image_pad|>"), video_token_id=vision_token_id("<|video_pad|>"),
        vision_start_token_id=vision_token_id("<|vision_start|>"),
        vision_end_token_id=vision_token_id("<|vision_end|>"),
    )  # fmt: skip


def tiny_vl_config(*, dtype: str = "float32", **overrides) -> dict:
    """The ``config.json`` content of a tiny Qwen3-VL (see module doc for ``overrides``)."""
    import transformers

    kwargs = _defaults()
    for key, value in overrides.items():
        if key in ("text_config", "vision_config"):
            kwargs[key] = {**kwargs[key], **value}
        elif key in kwargs:
            kwargs[key] = value
        else:
            raise ValueError(f"unknown qwen3_vl field {key!r} (text/vision fields go in text_config/vision_config)")
    text = kwargs["text_config"]
    if text["vocab_size"] < VL_VOCAB_SIZE:
        raise ValueError(f"text_config vocab_size={text['vocab_size']} is smaller than the tokenizer ({VL_VOCAB_SIZE})")
    if kwargs["vision_config"]["out_hidden_size"] != text["hidden_size"]:
        raise ValueError("vision_config out_hidden_size must equal text_config hidden_size")
    config = transformers.Qwen3VLConfig(**kwargs, dtype=dtype, architectures=["Qwen3VLForConditionalGeneration"])
    out = config.to_dict()
    rope = out["text_config"].get("rope_parameters") or {}
    out["text_config"]["rope_theta"] = rope.get("rope_theta")  # the 4.x spelling, as Hub checkpoints hold it
    out["text_config"]["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["text_config"]["dtype"] = out["vision_config"]["dtype"] = dtype
    out.pop("transformers_version", None)
    return json.loads(json.dumps(out, sort_keys=True))


def vl_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hub tensor name -> shape: the vision tower, then the Qwen3 text decoder under ``model.language_model``."""
    v = config["vision_config"]
    d, inter, m = v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"]
    merged = d * m * m
    p, patch = "model.visual.", v["patch_size"]
    shapes = {
        p + "patch_embed.proj.weight": (d, v["in_channels"], v["temporal_patch_size"], patch, patch),
        p + "patch_embed.proj.bias": (d,),
        p + "pos_embed.weight": (v["num_position_embeddings"], d),
    }
    for i in range(v["depth"]):
        b = f"{p}blocks.{i}."
        for name, shape in (("norm1", (d,)), ("norm2", (d,))):
            shapes[b + f"{name}.weight"], shapes[b + f"{name}.bias"] = shape, shape
        for name, (rows, cols) in (("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)), ("mlp.linear_fc1", (inter, d)),
                                   ("mlp.linear_fc2", (d, inter))):
            shapes[b + f"{name}.weight"], shapes[b + f"{name}.bias"] = (rows, cols), (rows,)
    mergers = [("merger.", d)] + [(f"deepstack_merger_list.{k}.", merged) for k in range(
        len(v["deepstack_visual_indexes"]))]  # fmt: skip
    for name, norm in mergers:
        shapes[p + name + "norm.weight"], shapes[p + name + "norm.bias"] = (norm,), (norm,)
        shapes[p + name + "linear_fc1.weight"], shapes[p + name + "linear_fc1.bias"] = (merged, merged), (merged,)
        shapes[p + name + "linear_fc2.weight"] = (v["out_hidden_size"], merged)
        shapes[p + name + "linear_fc2.bias"] = (v["out_hidden_size"],)
    text = {**config["text_config"], "model_type": "qwen3", "tie_word_embeddings": config["tie_word_embeddings"]}
    for name, shape in weight_shapes(text).items():
        shapes[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = shape
    return shapes


def vl_random_weights(config: dict, *, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    std = float(config["text_config"].get("initializer_range", 0.1))
    out = {}
    for name, shape in vl_weight_shapes(config).items():
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        scale = name.endswith(".weight") and name.rsplit(".", 2)[-2].startswith("norm") or name.endswith("norm.weight")
        out[name] = ((1.0 + 0.05 * w) if scale else std * w).to(dtype).contiguous()
    return out


def write_vl_tokenizer_and_processor(path: Path, *, model_max_length: int = 2048) -> None:
    """The tiny tokenizer with the vision tokens and the VL chat template, and the processor configs."""
    from tokenizers import AddedToken, Tokenizer

    tiny_tokenizer.write_tokenizer_files(path, model_max_length=model_max_length)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    assert tok.get_vocab_size() == VL_VOCAB_SIZE
    tok.save(str(path / "tokenizer.json"), pretty=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    for t in VISION_TOKENS:
        cfg["added_tokens_decoder"][str(vision_token_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    cfg["chat_template"] = VL_CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (path / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)
    common = dict(
        patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, merge_size=MERGE, image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD, do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
        do_convert_rgb=True, resample=3, processor_class="Qwen3VLProcessor",
    )  # fmt: skip
    image = dict(common, image_processor_type="Qwen2VLImageProcessor",
                 size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})  # fmt: skip
    video = dict(common, video_processor_type="Qwen3VLVideoProcessor", fps=2, min_frames=2, max_frames=8,
                 do_sample_frames=True, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS * 2})  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps(image, indent=2, sort_keys=True) + "\n")
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2, sort_keys=True) + "\n")


def make_tiny_vl_checkpoint(path, seed: int = 0, *, dtype=torch.float32, **overrides) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(dtype)
    config = tiny_vl_config(dtype=name, **overrides)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = vl_random_weights(config, seed=seed, dtype=getattr(torch, name))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = config["text_config"]
    generation = {
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": [text["eos_token_id"], tiny_tokenizer.token_id(tiny_tokenizer.PAD_TOKEN)],
        "pad_token_id": text["pad_token_id"],
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_vl_tokenizer_and_processor(path, model_max_length=text["max_position_embeddings"])
    return path
