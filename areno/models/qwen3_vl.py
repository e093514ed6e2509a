"""Qwen3-VL: a ViT tower and patch merger feeding the Qwen3 decoder, with DeepStack and interleaved M-RoPE.

Vision tower (one pass over every image of a batch, packed; per-image attention through ``cu_seqlens``):
- patch embedding: the checkpoint's Conv3d with stride == kernel ``(tp, p, p)`` is a linear map of each flattened
  ``[C, tp, p, p]`` patch (the processor emits patches flattened in that order, grouped in 2x2 merge blocks);
- learned position grid ``[side * side, D]`` resampled to each image's ``h x w`` patch grid (bilinear,
  align_corners=True: source coordinate ``i * (side - 1) / (h - 1)``), reordered to merge-block order;
- 2D rotary: the head dim's rotated half is ``[h * f, w * f]`` with ``f = theta^(-4k/d)``, ``k < d/4``, applied by
  areno's ``apply_rope`` through a per-token table (positions ``0..T-1`` index it);
- pre-norm blocks (LayerNorm, non-causal varlen ``attention``, GELU-tanh MLP);
- merger: LayerNorm per patch, concatenate each merge block's ``m*m`` patches, ``fc2(gelu(fc1(x)))`` to the text
  width. DeepStack mergers (LayerNorm after the concatenation) read the blocks listed in
  ``deepstack_visual_indexes``; feature ``k`` is added to the hidden state after decoder layer ``k`` at the image
  tokens.

Text side: areno's Qwen3 decoder. Positions are ``[T]`` (text only: plain RoPE) or ``[3, T]`` (t, h, w streams,
``mrope_positions``): rotary frequency ``j`` of the half head dim takes its angle from stream h when
``j % 3 == 1 and j < 3 * section[1]``, from w when ``j % 3 == 2 and j < 3 * section[2]``, else from t (the
interleaved layout). The per-token cos/sin are gathered from the usual tables, so the RoPE kernels are unchanged.

Hugging Face names: ``model.visual.*``, ``model.language_model.*``, ``lm_head.weight``; the tower is replicated
under TP (its parameters are small next to the decoder's, and a replicated tower needs no collective).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from areno.kernels.attention import attention
from areno.kernels.gemm import linear
from areno.kernels.rope import apply_rope
from areno.models.base import CausalLM, training_metadata
from areno.models.layers import Linear
from areno.models.model_config import ModelConfig, dense_config, get
from areno.models.registry import ModelCard, register
from areno.models.tp import layout

GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass
class Qwen3VLConfig(ModelConfig):
    vision: VisionConfig | None = None
    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])
    image_token_id: int = -1
    video_token_id: int = -1
    vision_start_token_id: int = -1
    vision_end_token_id: int = -1


def vision_config(vis, model_type: str, deepstack: bool = True) -> VisionConfig:
    """The tower's settings from a ``vision_config`` (Qwen3.5's tower has no DeepStack mergers: ``deepstack``
    False)."""
    act = get(vis, "hidden_act", "gelu_pytorch_tanh")
    if act not in GELU:
        raise NotImplementedError(f"{model_type}: vision hidden_act {act!r} is not supported ({sorted(GELU)} are)")
    vrope = dict(get(vis, "rope_parameters", None) or {})
    patch, temporal = get(vis, "patch_size", 16), get(vis, "temporal_patch_size", 2)
    if not isinstance(patch, int) or not isinstance(temporal, int):
        raise NotImplementedError(f"{model_type}: non-square patch sizes are not supported")
    vision = VisionConfig(
        depth=get(vis, "depth"),
        hidden_size=get(vis, "hidden_size"),
        intermediate_size=get(vis, "intermediate_size"),
        num_heads=get(vis, "num_heads"),
        out_hidden_size=get(vis, "out_hidden_size"),
        in_channels=get(vis, "in_channels", 3),
        patch_size=patch,
        temporal_patch_size=temporal,
        spatial_merge_size=get(vis, "spatial_merge_size", 2),
        num_position_embeddings=get(vis, "num_position_embeddings", 2304),
        deepstack_visual_indexes=list(get(vis, "deepstack_visual_indexes", [8, 16, 24])) if deepstack else [],
        hidden_act=act,
        rope_theta=float(vrope.get("rope_theta", 10000.0)),
    )
    return vision


def qwen3_vl_config(hf) -> Qwen3VLConfig:
    text, vis = get(hf, "text_config"), get(hf, "vision_config")
    if text is None or vis is None:
        raise ValueError("qwen3_vl: config.json needs text_config and vision_config")
    tie = get(hf, "tie_word_embeddings", None)
    base = dense_config(text, "qwen3_vl", qk_norm=True, tie_word_embeddings=bool(
        get(text, "tie_word_embeddings", False) if tie is None else tie))  # fmt: skip
    if base.rope_scaling is not None:
        raise NotImplementedError(f"qwen3_vl: rope_type {base.rope_scaling.get('rope_type')!r} is not supported")
    rope = dict(get(text, "rope_parameters", None) or get(text, "rope_scaling", None) or {})
    section = list(rope.get("mrope_section", [24, 20, 20]))
    if sum(section) != base.rotary_dim // 2 or len(section) != 3:
        raise ValueError(f"qwen3_vl: mrope_section {section} must be 3 numbers summing to head_dim/2")
    vision = vision_config(vis, "qwen3_vl")
    if vision.out_hidden_size != base.hidden_size:
        raise ValueError(f"qwen3_vl: vision out_hidden_size {vision.out_hidden_size} != text hidden_size")
    if len(vision.deepstack_visual_indexes) > base.num_layers:
        raise ValueError("qwen3_vl: more DeepStack features than decoder layers")
    return Qwen3VLConfig(
        **asdict(base), vision=vision, mrope_section=section,
        image_token_id=get(hf, "image_token_id", 151655), video_token_id=get(hf, "video_token_id", 151656),
        vision_start_token_id=get(hf, "vision_start_token_id", 151652),
        vision_end_token_id=get(hf, "vision_end_token_id", 151653),
    )  # fmt: skip


# ---- positions ---------------------------------------------------------------------------------------------------


def mrope_positions(input_ids: torch.Tensor, image_grid_thw, *, image_token_id: int, spatial_merge_size: int,
                    cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """``[3, T]`` (t, h, w) positions of a packed batch and each sequence's decode offset.

    Per sequence: text tokens count up on all three streams; an image's ``t * h * w / m^2`` placeholder tokens (in
    the order of ``image_grid_thw`` rows, images taken in order over the packed batch) sit on the grid
    ``(start + t_i, start + h_i, start + w_i)`` and advance the counter by ``max(h, w) / m``. A token generated
    at index ``n`` (0-based within its sequence) after the prompt sits at ``n + delta`` on every stream, with
    ``delta = max(prompt positions) + 1 - prompt length`` (the second return value, one per sequence).
    """
    ids = input_ids.tolist()
    bounds = [0, len(ids)] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    grids = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.tolist()]
    m, g_next = spatial_merge_size, 0
    out, deltas = [], []
    for s, e in zip(bounds[:-1], bounds[1:]):
        pos, i, seq = 0, s, []
        while i < e:
            if ids[i] != image_token_id:
                j = i
                while j < e and ids[j] != image_token_id:
                    j += 1
                seq.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos, i = pos + j - i, j
                continue
            if g_next >= len(grids):
                raise ValueError("more image placeholder runs in input_ids than rows in image_grid_thw")
            t, h, w = grids[g_next]
            g_next += 1
            n = t * (h // m) * (w // m)
            if i + n > e or any(x != image_token_id for x in ids[i : i + n]):
                raise ValueError(f"image {g_next - 1} (grid {t}x{h}x{w}) needs {n} consecutive placeholder tokens")
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h // m), torch.arange(w // m),
                                              indexing="ij")).reshape(3, -1)  # fmt: skip
            seq.append(grid + pos)
            pos, i = pos + max(h, w) // m, i + n
        positions = torch.cat(seq, dim=1) if seq else torch.zeros(3, 0, dtype=torch.int64)
        out.append(positions)
        deltas.append(int(positions.max()) + 1 - (e - s) if e > s else 0)
    if g_next != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} rows but input_ids hold {g_next} images")
    return torch.cat(out, dim=1).to(input_ids.device), deltas


def mrope_streams(section: list[int], half: int) -> torch.Tensor:
    """int64 ``[half]``: which position stream (0 t, 1 h, 2 w) drives each rotary frequency (interleaved)."""
    j = torch.arange(half)
    streams = torch.zeros(half, dtype=torch.int64)
    streams[(j % 3 == 1) & (j < 3 * section[1])] = 1
    streams[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return streams


# ---- vision tower -------------------------------------------------------------------------------------------------


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class PatchProjection(nn.Module):
    """The Conv3d ``[D, C, tp, p, p]`` (stride == kernel) as a GEMM over flattened patches."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        p, tp = vc.patch_size, vc.temporal_patch_size
        self.weight = nn.Parameter(torch.empty(vc.hidden_size, vc.in_channels, tp, p, p))
        self.bias = nn.Parameter(torch.empty(vc.hidden_size))

    def forward(self, patches):
        return linear(patches.reshape(-1, self.weight[0].numel()), self.weight.flatten(1), self.bias)


class PatchEmbed(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.proj = PatchProjection(vc)

    def forward(self, patches):
        return self.proj(patches)


class PositionGrid(nn.Module):
    """The learned ``[side * side, D]`` grid, resampled per image (see module doc)."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vc.num_position_embeddings, vc.hidden_size))
        self.side, self.merge = int(vc.num_position_embeddings**0.5), vc.spatial_merge_size

    def forward(self, grids: list[tuple[int, int, int]]):
        side, m, d = self.side, self.merge, self.weight.shape[1]
        table = self.weight.view(side, side, d).permute(2, 0, 1)[None].float()
        out = []
        for t, h, w in grids:
            g = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
            g = g.reshape(h // m, m, w // m, m, d).transpose(1, 2).reshape(h * w, d)
            out.append(g.repeat(t, 1))
        return torch.cat(out).to(self.weight.dtype)


def vision_rope(grids, head_dim: int, theta: float, merge: int, device):
    """Per-token fp32 ``(cos, sin) [T, head_dim/2]`` of the 2D rotary, tokens in merge-block order."""
    quarter, m = head_dim // 2, merge
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter))
    hw = []
    for t, h, w in grids:
        hpos = torch.arange(h, device=device)[:, None].expand(h, w)
        wpos = torch.arange(w, device=device)[None, :].expand(h, w)
        pos = torch.stack([hpos, wpos], dim=-1).reshape(h // m, m, w // m, m, 2).transpose(1, 2).reshape(-1, 2)
        hw.append(pos.repeat(t, 1))
    hw = torch.cat(hw).float()
    angles = torch.cat([hw[:, :1] * inv_freq, hw[:, 1:] * inv_freq], dim=-1)
    return angles.cos(), angles.sin()


class VisionAttention(nn.Module):
    def __init__(self, vc: VisionConfig, backend):
        super().__init__()
        self.qkv = Linear(vc.hidden_size, 3 * vc.hidden_size, bias=True)
        self.proj = Linear(vc.hidden_size, vc.hidden_size, bias=True)
        self.heads, self.head_dim, self.backend = vc.num_heads, vc.head_dim, backend

    def forward(self, x, rope, index, cu_seqlens, max_seqlen):
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, index, *rope), apply_rope(k, index, *rope)
        o = attention(q, k, v.contiguous(), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=False,
                      softmax_scale=self.head_dim**-0.5, backend=self.backend)  # fmt: skip
        return self.proj(o.reshape(t, -1))


class VisionMLP(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.linear_fc1 = Linear(vc.hidden_size, vc.intermediate_size, bias=True)
        self.linear_fc2 = Linear(vc.intermediate_size, vc.hidden_size, bias=True)
        self.approximate = GELU[vc.hidden_act]

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig, backend):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm(vc.hidden_size), LayerNorm(vc.hidden_size)
        self.attn = VisionAttention(vc, backend)
        self.mlp = VisionMLP(vc)

    def forward(self, x, rope, index, cu_seqlens, max_seqlen):
        x = x + self.attn(self.norm1(x), rope, index, cu_seqlens, max_seqlen)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """``m * m`` neighbouring patches -> one text-width token. DeepStack mergers normalise after concatenating."""

    def __init__(self, vc: VisionConfig, postshuffle: bool):
        super().__init__()
        self.dim = vc.hidden_size * vc.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = LayerNorm(self.dim if postshuffle else vc.hidden_size)
        self.linear_fc1 = Linear(self.dim, self.dim, bias=True)
        self.linear_fc2 = Linear(self.dim, vc.out_hidden_size, bias=True)

    def forward(self, x):
        x = self.norm(x.view(-1, self.dim)) if self.postshuffle else self.norm(x).view(-1, self.dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """``pixel_values [N, C*tp*p*p], grid_thw [n, 3] -> (embeds [N/m^2, H], deepstack [K, N/m^2, H])``."""

    def __init__(self, vc: VisionConfig, attn_backend: str = "flash"):
        super().__init__()
        self.config = vc
        backend = "native" if attn_backend == "native" else None
        self.patch_embed = PatchEmbed(vc)
        self.pos_embed = PositionGrid(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc, backend) for _ in range(vc.depth))
        self.merger = PatchMerger(vc, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(vc, True) for _ in vc.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw):
        vc = self.config
        grids = [tuple(int(v) for v in g) for g in torch.as_tensor(grid_thw).tolist()]
        m = vc.spatial_merge_size
        bad = [g for g in grids if g[1] % m or g[2] % m]
        if bad:
            raise ValueError(f"qwen3_vl: image grids {bad} are not multiples of spatial_merge_size {m}")
        n = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (n, vc.patch_dim):
            raise ValueError(f"qwen3_vl: pixel_values must be [{n}, {vc.patch_dim}] for grids {grids}, "
                             f"got {tuple(pixel_values.shape)}")  # fmt: skip
        dev = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype))
        x = x + self.pos_embed(grids)
        rope = vision_rope(grids, vc.head_dim, vc.rope_theta, m, dev)
        index = torch.arange(n, device=dev)
        lens = [h * w for t, h, w in grids for _ in range(t)]
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, index, cu, max(lens))
            if i in vc.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[vc.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), torch.stack(deepstack) if deepstack else x.new_zeros(0, n // m**2, vc.out_hidden_size)


# ---- the model ----------------------------------------------------------------------------------------------------


class Qwen3VLForConditionalGeneration(CausalLM):
    """The Qwen3 decoder with a vision tower. See the module doc for the forward contract."""

    is_multimodal = True

    def __init__(self, cfg: Qwen3VLConfig, *, attn_backend: str = "flash"):
        super().__init__(cfg, attn_backend=attn_backend)
        self.visual = VisionTower(cfg.vision, attn_backend)
        self._frozen_media: list[nn.Module] = []  # set by freeze_media: kept in eval mode by train()
        self.register_buffer("mrope_streams", None, persistent=False)

    def init_buffers(self, device=None) -> None:
        super().init_buffers(device)
        cfg = self.config
        self.mrope_streams = mrope_streams(cfg.mrope_section, cfg.rotary_dim // 2).to(self.rope[0].device)

    def tower_parameters(self) -> list[nn.Parameter]:
        """The vision encoder (patch embedding, position grid, blocks): ``--unfreeze-mm-tower``."""
        v = self.visual
        return [*v.patch_embed.parameters(), *v.pos_embed.parameters(), *v.blocks.parameters()]

    def projector_parameters(self) -> list[nn.Parameter]:
        """The merger and the DeepStack mergers: ``--unfreeze-mm-projector``."""
        return [*self.visual.merger.parameters(), *self.visual.deepstack_merger_list.parameters()]

    def freeze_media(self, *, tower: bool = True, projector: bool = True) -> None:
        """Freeze the tower and/or the projector (the training default): no gradients, eval mode, which ``train()``
        keeps."""
        v = self.visual
        self._frozen_media = [*([v.patch_embed, v.pos_embed, v.blocks] if tower else []),
                              *([v.merger, v.deepstack_merger_list] if projector else [])]  # fmt: skip
        for module in self._frozen_media:
            module.requires_grad_(False)
            module.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        for module in self._frozen_media:
            module.train(False)
        return self

    def encode_images(self, pixel_values, image_grid_thw):
        """``(embeds [N, H], deepstack [K, N, H])`` for the image tokens of ``image_grid_thw`` (rows in order)."""
        return self.visual(pixel_values, image_grid_thw)

    def mrope_positions(self, input_ids, image_grid_thw, cu_seqlens=None):
        """``([3, T] positions, per-sequence decode deltas)``: see ``mrope_positions``."""
        return mrope_positions(input_ids, image_grid_thw, image_token_id=self.config.image_token_id,
                               spatial_merge_size=self.config.vision.spatial_merge_size, cu_seqlens=cu_seqlens)

    def rope_for(self, positions):
        """``(positions for the kernels, (cos, sin) tables)``: [3, T] positions gather per-token tables."""
        if positions.dim() == 1:
            return positions, self.rope
        cos, sin = self.rope
        t = positions.shape[1]
        pick = self.mrope_streams.view(1, 1, -1).expand(1, t, -1)
        cos = cos[positions].gather(0, pick)[0]
        sin = sin[positions].gather(0, pick)[0]
        return torch.arange(t, device=positions.device), (cos, sin)

    def forward(self, input_ids, positions, cu_seqlens=None, max_seqlen=None, *, kv_caches=None,
                attn_metadata=None, pixel_values=None, image_grid_thw=None, image_embeds=None,
                image_rows=None):  # fmt: skip
        """Final hidden states ``[T, H]``. Images come as ``pixel_values``/``image_grid_thw`` (the tower runs here)
        or as ``image_embeds=(embeds, deepstack)`` from ``encode_images`` (rows for exactly the image tokens of
        ``input_ids``, in order); ``positions`` is ``[3, T]`` whenever the tokens hold an image. ``image_rows``
        (int64 ``[N]``, the engine's steps): the rows of ``input_ids`` that take the embeddings, instead of every
        ``image_token_id`` (a generated or literal placeholder id elsewhere in a batch stays a text token)."""
        meta = attn_metadata if attn_metadata is not None else training_metadata(input_ids, cu_seqlens, max_seqlen)
        if pixel_values is not None:
            if image_embeds is not None:
                raise ValueError("pass pixel_values or image_embeds, not both")
            image_embeds = self.encode_images(pixel_values, image_grid_thw)
        h, residual = self.embed_tokens(input_ids), None
        index, deepstack = None, ()
        if image_embeds is not None:
            embeds, deepstack = image_embeds
            index = (input_ids == self.config.image_token_id).nonzero().squeeze(1) if image_rows is None else image_rows
            if index.numel() != embeds.shape[0]:
                raise ValueError(f"input_ids hold {index.numel()} image tokens but the images give {embeds.shape[0]}")
            h = h.index_copy(0, index, embeds.to(h.dtype))
        rope_positions, rope = self.rope_for(positions)
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope_positions, rope, meta, None if kv_caches is None else kv_caches[i])
            if i < len(deepstack):
                h = h.index_add(0, index, deepstack[i].to(h.dtype))
        return self.norm(h, residual)[0]

    def hf_layouts(self) -> dict:
        out = super().hf_layouts()
        for lays in out.values():
            for lay in lays:
                for part in lay.parts:
                    if part.hf_name.startswith("model."):
                        part.hf_name = "model.language_model." + part.hf_name[len("model."):]
        for name, p in self.visual.named_parameters():
            out[f"visual.{name}"] = [layout(tuple(p.shape), 0, [(f"model.visual.{name}", p.shape[0])])]
        return out


register("qwen3_vl", qwen3_vl_config, Qwen3VLForConditionalGeneration,
         card=ModelCard("Qwen3-VL", ("dense", "vision"),
                        notes="images in prompts and requests; tower/projector frozen unless `--unfreeze-mm-*`"))
