"""Qwen3.5 vision-language (the Hub's ``qwen3_5`` / ``qwen3_5_moe`` checkpoints, ``Qwen3_5ForConditionalGeneration``):
the Qwen3.5 hybrid decoder (``qwen3_5_layers.Qwen35ForCausalLM``) fed by Qwen3-VL's vision tower, merger, M-RoPE
positions and image forward (``qwen3_vl.py``), reused as they are.

Where Qwen3.5's vision side differs from Qwen3-VL's: the tower has no DeepStack mergers (no features added after
decoder layers: ``deepstack_visual_indexes`` is empty); the text RoPE is partial (``partial_rotary_factor``, e.g. 64
of 256 dims) with ``mrope_section`` (e.g. [11, 11, 10]) summing to half the rotary dim, in the same interleaved
layout. Everything else (patch projection, resampled position grid, 2D rotary, blocks, merger, placeholder positions)
agrees. Hugging Face names: ``model.visual.*``, ``model.language_model.*``, ``lm_head.weight``; the ``mtp.*`` tensors
are kept and saved untouched. Videos are not taken (as for Qwen3-VL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areno.models.model_config import get
from areno.models.qwen3_5_layers import Qwen35Config, Qwen35ForCausalLM, qwen3_5_config
from areno.models.qwen3_vl import Qwen3VLForConditionalGeneration, VisionConfig, vision_config
from areno.models.tp import layout


@dataclass
class Qwen35VLConfig(Qwen35Config):
    vision: VisionConfig | None = None
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])
    image_token_id: int = -1
    video_token_id: int = -1
    vision_start_token_id: int = -1
    vision_end_token_id: int = -1


def qwen3_5_vl_config(hf) -> Qwen35VLConfig:
    name = get(hf, "model_type")
    text, vis = get(hf, "text_config", None), get(hf, "vision_config", None)
    if text is None or vis is None:
        raise ValueError(f"{name}: config.json needs text_config and vision_config")
    base = qwen3_5_config(hf)
    rope = dict(get(text, "rope_parameters", None) or {})
    section = list(rope.get("mrope_section", [11, 11, 10]))
    if len(section) != 3 or sum(section) != base.rotary_dim // 2:
        raise NotImplementedError(f"{name}: mrope_section {section} must be 3 numbers summing to the rotary dim / 2 "
                                  f"({base.rotary_dim // 2})")
    if rope.get("mrope_interleaved", True) is False:
        raise NotImplementedError(f"{name}: mrope_interleaved=false is not supported (the interleaved layout is)")
    vision = vision_config(vis, name, deepstack=False)
    if vision.out_hidden_size != base.hidden_size:
        raise ValueError(f"{name}: vision out_hidden_size {vision.out_hidden_size} != text hidden_size")
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    return Qwen35VLConfig(
        **fields, vision=vision, mrope_section=section,
        image_token_id=get(hf, "image_token_id", 248056), video_token_id=get(hf, "video_token_id", 248057),
        vision_start_token_id=get(hf, "vision_start_token_id", 248053),
        vision_end_token_id=get(hf, "vision_end_token_id", 248054),
    )  # fmt: skip


class Qwen35VLForConditionalGeneration(Qwen3VLForConditionalGeneration, Qwen35ForCausalLM):
    """Qwen3-VL's multimodal forward and tower over the Qwen3.5 decoder (engine sizes, layouts from Qwen3.5)."""

    def keep_hf_tensor(self, hf_name: str) -> bool:
        return hf_name.startswith("mtp.")

    def hf_layouts(self) -> dict:
        out = Qwen35ForCausalLM.hf_layouts(self)
        for name, p in self.visual.named_parameters():
            out[f"visual.{name}"] = [layout(tuple(p.shape), 0, [(f"model.visual.{name}", p.shape[0])])]
        return out

