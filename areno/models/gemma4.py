"""Gemma 4 (``gemma4_text``, and the language model of ``gemma4`` checkpoints) on areno's kernels.

What it implements, as transformers' Gemma4TextModel: sliding-window and full layers (``layer_types``), each with its
head dim and KV heads (``per_layer_config``, or the Hub's ``global_head_dim`` / ``num_global_key_value_heads``) and
its RoPE (``rope_parameters`` per layer type: default on the sliding layers, proportional partial RoPE on the full
ones: the first ``partial_rotary_factor * head_dim / 2`` frequencies of the full head dim, the rest unrotated);
``attention_k_eq_v`` (v is the raw k on full layers); KV-shared layers (the last ``num_kv_shared_layers`` reuse the
K/V of the last earlier layer of their type: in training and in the engine's paged cache, where they own no blocks
and attend with their source layer's KV-cache group, so sliding layers drop the blocks left of the window);
per-layer input embeddings (PLE); the MoE block beside the dense MLP (``enable_moe_block``); ``use_double_wide_mlp``;
embeddings scaled by sqrt(hidden) (rounded to the weights' dtype, as transformers does); final logit soft-capping in
``compute_logits``, ``token_logprobs`` and the engine's sampling (the trainer takes ``token_logprobs`` for a
soft-capped model). The paged cache holds one flat row of the widest layer's ``Hkv * head_dim`` per token; each layer
views its own ``[Hkv, head_dim]`` part of it.

``gemma4`` checkpoints: the language model's tensors load by their Hub names (``model.language_model.*``); the
vision and audio towers and their embedders are kept opaque (frozen, saved untouched, 0-d clipped-linear bounds
included), so the model is text-only.
KV-shared layers' k/v tensors, when a checkpoint holds them (transformers ignores them), are kept the same way.

Refused at load in one line, naming the field: an activation other than gelu tanh, attention dropout, attention
bias, ``use_bidirectional_attention="all"``, layer types other than sliding/full, other RoPE types, per-layer
overrides other than head dim and KV heads.

Tensor parallel: query heads split, each layer's KV heads split or replicated (a full layer's one KV head is held by
every rank), dense MLPs split, vocab-parallel embedding and head (the soft-capped log-probs gather the logits); the
per-layer-input projections, the router and the MoE experts are replicated (every rank runs the whole MoE block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areno.kernels.rope import rope_cos_sin
from areno.models.base import CausalLM
from areno.models.gemma4_layers import Gemma4Attention, Gemma4DecoderLayer, Gemma4MLP, softcapped_logprobs
from areno.models.layers import KeptTensors, Linear, RMSNorm, VocabEmbedding
from areno.models.model_config import ModelConfig, get
from areno.models.registry import ModelCard, register
from areno.models.tp import layout

LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


@dataclass
class Gemma4Config(ModelConfig):
    layer_types: list[str] = field(default_factory=list)
    layer_head_dims: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    kv_source: list[int] = field(default_factory=list)  # the layer whose K/V each layer attends to (itself if own)
    k_eq_v: bool = False
    ropes: dict = field(default_factory=dict)  # layer type -> (theta, scaling or None)
    final_logit_softcapping: float | None = None
    ple_dim: int = 0  # hidden_size_per_layer_input (0: no per-layer inputs)
    ple_vocab: int = 0
    hf_prefix: str = "model."  # "model.language_model." in gemma4 checkpoints
    double_wide: bool = False  # use_double_wide_mlp: the KV-shared layers' MLPs are twice as wide


def _refuse(field_name: str, value, why: str):
    raise NotImplementedError(f"gemma4: {field_name}={value!r} is not supported ({why})")


def _layer_overrides(raw: dict, layer_types: list[str]) -> dict[int, dict]:
    """Per-layer ``{head_dim, num_key_value_heads}`` overrides: transformers' ``per_layer_config``, or the Hub's
    ``global_head_dim`` / ``num_global_key_value_heads`` on the full layers (as transformers derives them)."""
    per_layer = raw.get("per_layer_config")
    if per_layer is None:
        over = {"head_dim": raw.get("global_head_dim", 512)}
        if raw.get("num_global_key_value_heads") is not None and raw.get("attention_k_eq_v", True):
            over["num_key_value_heads"] = raw["num_global_key_value_heads"]
        return {i: over for i, t in enumerate(layer_types) if t == "full_attention"}
    out = {}
    for key, over in per_layer.items():
        bad = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if bad:
            _refuse(f"per_layer_config[{key}]", {k: over[k] for k in bad}, "head_dim/num_key_value_heads are")
        index = int(key) if str(key).isdigit() else None
        targets = [index] if index is not None else [i for i, t in enumerate(layer_types) if t == key]
        for i in targets:
            out.setdefault(i, {}).update(over)
    return out


def _ropes(raw: dict) -> dict:
    params = raw.get("rope_parameters") or {}
    out = {}
    for t in LAYER_TYPES:
        p = dict(params.get(t) or {})
        kind = p.get("rope_type", "default")
        if kind == "default":
            out[t] = (float(p.get("rope_theta", 10000.0)), None)
        elif kind == "proportional":
            out[t] = (float(p["rope_theta"]), {"rope_type": "proportional", "factor": p.get("factor", 1.0),
                                               "partial_rotary_factor": p.get("partial_rotary_factor", 1.0)})
        else:
            _refuse(f"rope_parameters[{t}].rope_type", kind, "default and proportional are")
    return out


def _kv_sources(layer_types: list[str], shared: int) -> list[int]:
    n = len(layer_types)
    first = n - shared
    if shared and (first <= 0 or set(layer_types[first:]) - set(layer_types[:first])):
        _refuse("num_kv_shared_layers", shared, "every shared layer needs an earlier unshared layer of its type")
    last = {t: i for i, t in enumerate(layer_types[:first])}
    return [i if i < first else last[layer_types[i]] for i in range(n)]


def gemma4_text_config(raw: dict, model_type: str, prefix: str = "model.", tie=None) -> Gemma4Config:
    """A ``gemma4_text`` config dict (transformers' ``to_dict`` or config.json) -> Gemma4Config, or a refusal."""
    act = get(raw, "hidden_activation", None) or get(raw, "hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        _refuse("hidden_activation", act, "gelu_pytorch_tanh is")
    if float(get(raw, "attention_dropout", 0.0)):
        _refuse("attention_dropout", raw["attention_dropout"], "0.0 is")
    if get(raw, "attention_bias", False):
        _refuse("attention_bias", True, "Gemma 4 has none")
    if get(raw, "use_bidirectional_attention", None) == "all":
        _refuse("use_bidirectional_attention", "all", "causal attention only")
    n = get(raw, "num_hidden_layers")
    layer_types = list(get(raw, "layer_types", None) or
                       ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    if len(layer_types) != n or set(layer_types) - set(LAYER_TYPES):
        _refuse("layer_types", layer_types, f"{n} of {LAYER_TYPES}")
    layer_types[-1] = "full_attention"  # transformers forces it (with a warning)
    heads = get(raw, "num_attention_heads")
    head_dim, kv_heads = get(raw, "head_dim", 256), get(raw, "num_key_value_heads", heads)
    over = _layer_overrides(raw, layer_types)
    window = get(raw, "sliding_window", None)
    if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
        _refuse("sliding_window", window, "a positive int for the sliding layers")
    moe = bool(get(raw, "enable_moe_block", False))
    shared = int(get(raw, "num_kv_shared_layers", 0))
    sources = _kv_sources(layer_types, shared)
    cfg = Gemma4Config(
        model_type=model_type, vocab_size=get(raw, "vocab_size"), hidden_size=get(raw, "hidden_size"),
        intermediate_size=get(raw, "intermediate_size"), num_layers=n, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=get(raw, "rms_norm_eps", 1e-6),
        max_position_embeddings=get(raw, "max_position_embeddings", 131072),
        tie_word_embeddings=bool(get(raw, "tie_word_embeddings", True) if tie is None else tie),
        sliding_window=window, sliding_layers=[i for i, t in enumerate(layer_types) if t == "sliding_attention"],
        num_experts=get(raw, "num_experts", 0) if moe else 0,
        num_experts_per_tok=get(raw, "top_k_experts", 0) if moe else 0,
        moe_intermediate_size=get(raw, "moe_intermediate_size", 0) if moe else 0,
        layer_types=layer_types, layer_head_dims=[over.get(i, {}).get("head_dim", head_dim) for i in range(n)],
        layer_kv_heads=[over.get(i, {}).get("num_key_value_heads", kv_heads) for i in range(n)],
        kv_source=sources, k_eq_v=bool(get(raw, "attention_k_eq_v", False)), ropes=_ropes(raw),
        final_logit_softcapping=get(raw, "final_logit_softcapping", None),
        ple_dim=int(raw.get("hidden_size_per_layer_input", 256) or 0),
        ple_vocab=get(raw, "vocab_size_per_layer_input", 262144),
        hf_prefix=prefix, double_wide=bool(get(raw, "use_double_wide_mlp", False)),
    )  # fmt: skip
    if moe and not (cfg.num_experts and cfg.num_experts_per_tok and cfg.moe_intermediate_size):
        _refuse("enable_moe_block", True, "needs num_experts, top_k_experts and moe_intermediate_size")
    return cfg


def _as_dict(hf) -> dict:
    return dict(hf) if isinstance(hf, dict) else hf.to_dict()


def gemma4_config(hf) -> Gemma4Config:
    raw = _as_dict(hf)
    if raw.get("model_type") == "gemma4":  # the multimodal checkpoint: its language model
        text = _as_dict(raw.get("text_config") or {})
        return gemma4_text_config(text, "gemma4", "model.language_model.", raw.get("tie_word_embeddings", True))
    return gemma4_text_config(raw, "gemma4_text")


class Gemma4ForCausalLM(CausalLM):
    layer_class = Gemma4DecoderLayer

    def __init__(self, cfg: Gemma4Config, *, attn_backend: str = "flash"):
        wide = lambda i: cfg.intermediate_size * (2 if cfg.double_wide and cfg.kv_source[i] != i else 1)  # noqa: E731
        super().__init__(cfg, attn_backend=attn_backend, mlp_factory=lambda c, i: Gemma4MLP(c, wide(i)),
                         attn_factory=lambda c, i: Gemma4Attention(c, i, attn_backend))
        self.logit_softcap = cfg.final_logit_softcapping
        routed = [layer.moe for layer in self.layers if layer.moe is not None]
        for j, moe in enumerate(routed):
            moe.moe_index = j
        self.num_moe_layers, self.moe_top_k = len(routed), cfg.num_experts_per_tok if routed else 0
        if cfg.ple_dim:
            n, p = cfg.num_layers, cfg.ple_dim
            self.embed_tokens_per_layer = VocabEmbedding(cfg.ple_vocab, n * p)
            self.per_layer_model_projection = Linear(cfg.hidden_size, n * p)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps)
        self.producers = {s for i, s in enumerate(cfg.kv_source) if s != i}
        self.kept = KeptTensors()  # opaque tensors (towers, shared layers' k/v), see keep_hf_tensor
        self.ropes = None

    # ---- sizes and capabilities ------------------------------------------------------------------------------
    @property
    def kv_cache_layers(self) -> list[int]:
        """The layers that own K/V blocks: all but the KV-shared ones."""
        return [i for i, s in enumerate(self.config.kv_source) if s == i]

    @property
    def kv_width(self) -> int:
        """Elements of one token's K (or V) row in the paged cache: the widest layer's local ``Hkv * head_dim``."""
        return max(self.layers[i].self_attn.num_kv_heads * self.layers[i].self_attn.head_dim
                   for i in self.kv_cache_layers)

    @property
    def kv_cache_layout(self) -> tuple:
        return 2, (self.kv_width,)

    @property
    def kv_head_dim(self) -> int:
        return self.kv_width

    @property
    def kv_scale_heads(self) -> int:
        """An FP8 cache's scales per token and tensor (--kv-cache-dtype fp8): the most local KV heads of a layer."""
        return max(self.layers[i].self_attn.num_kv_heads for i in self.kv_cache_layers)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple:
        return (num_blocks, block_size, self.kv_width)

    def layer_cache(self, kv_caches, i: int):
        """Layer i's ``(k_cache, v_cache)`` ``[blocks, block_size, Hkv_i, D_i]``: its K/V source's flat rows (an FP8
        cache: then its ``(k_scale, v_scale)`` ``[blocks, block_size, Hkv_i]``, the first heads of the scale rows)."""
        attn = self.layers[i].self_attn
        hkv, d = attn.num_kv_heads, attn.head_dim
        entry = kv_caches[self.config.kv_source[i]]
        return tuple(c[..., : hkv * d].unflatten(-1, (hkv, d)) for c in entry[:2]) + tuple(s[..., :hkv]
                                                                                         for s in entry[2:])

    def init_buffers(self, device=None) -> None:
        cfg = self.config
        device = device or self.embed_tokens.weight.device
        tables = {}
        for t, d in zip(cfg.layer_types, cfg.layer_head_dims):
            if (t, d) not in tables:
                theta, scaling = cfg.ropes[t]
                tables[t, d] = rope_cos_sin(d, cfg.max_position_embeddings, theta, rope_scaling=scaling, device=device)
        self.ropes = [tables[t, d] for t, d in zip(cfg.layer_types, cfg.layer_head_dims)]
        self.rope = self.ropes[0]
        dtype = self.embed_tokens.weight.dtype  # transformers rounds the scales to the weights' dtype
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5).to(dtype))
        self.ple_scale = float(torch.tensor(cfg.ple_dim**0.5).to(dtype))
        for module in self.modules():
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers(device)

    # ---- forward -------------------------------------------------------------------------------------------------
    def per_layer_inputs(self, input_ids, h):
        """``[T, L, P]``: (norm(proj(embeds) / sqrt(H)) + ple_embed(ids) * sqrt(P)) / sqrt(2)."""
        cfg = self.config
        n, p = cfg.num_layers, cfg.ple_dim
        tokens = (self.embed_tokens_per_layer(input_ids) * self.ple_scale).view(-1, n, p)
        proj = (self.per_layer_model_projection(h) * cfg.hidden_size**-0.5).view(-1, n, p)
        return (self.per_layer_projection_norm(proj) + tokens) * 2.0**-0.5

    def forward(self, input_ids, positions, cu_seqlens=None, max_seqlen=None, *, kv_caches=None, attn_metadata=None,
                routed_experts=None):
        meta = self.step_metadata(input_ids, cu_seqlens, max_seqlen, attn_metadata, routed_experts)
        h = self.embed_tokens(input_ids) * self.embed_scale
        ple = self.per_layer_inputs(input_ids, h) if self.config.ple_dim else None
        kept, grouped = {}, meta.layer_groups is not None  # KV-cache groups: a shared layer reads its source's
        for i, layer in enumerate(self.layers):
            cache = None if kv_caches is None else self.layer_cache(kv_caches, i)
            src = self.config.kv_source[i]
            h, kv = layer(h, None if ple is None else ple[:, i], positions, self.ropes[i],
                          meta.for_layer(src) if grouped else meta, cache, kept.get(src) if src != i else None)
            if i in self.producers:
                kept[i] = kv
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def token_logprobs(self, hidden, targets, *, temperature=1.0, return_entropy=False, chunk_size=None):
        if self.logit_softcap is None:
            return super().token_logprobs(hidden, targets, temperature=temperature, return_entropy=return_entropy,
                                          chunk_size=chunk_size)
        return softcapped_logprobs(hidden, self.lm_head_weight, targets, self.logit_softcap, temperature=temperature,
                                   return_entropy=return_entropy, chunk_size=chunk_size, tp_group=self.tp_group)

    # ---- weights -------------------------------------------------------------------------------------------------
    def keep_hf_tensor(self, hf_name: str) -> bool:
        """Opaque: the towers of a ``gemma4`` checkpoint, and k/v tensors of KV-shared layers."""
        if hf_name.startswith(TOWERS):
            return True
        prefix = f"{self.config.hf_prefix}layers."
        if not hf_name.startswith(prefix):
            return False
        index, _, rest = hf_name[len(prefix) :].partition(".")
        return (index.isdigit() and int(index) < self.num_layers and self.layers[int(index)].self_attn.shared
                and rest.startswith(("self_attn.k_", "self_attn.v_")))

    def add_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> str:
        """Hold ``tensor`` as a frozen parameter saved back under ``hf_name``; returns its name."""
        return f"kept.{self.kept.add(hf_name, tensor)}"

    def hf_layouts(self) -> dict:
        cfg, pre = self.config, self.config.hf_prefix
        h, v = cfg.hidden_size, cfg.vocab_size
        out = {"embed_tokens.weight": [layout((v, h), 0, [(f"{pre}embed_tokens.weight", v)])]}
        if cfg.ple_dim:
            w = cfg.num_layers * cfg.ple_dim
            out["embed_tokens_per_layer.weight"] = [
                layout((cfg.ple_vocab, w), 0, [(f"{pre}embed_tokens_per_layer.weight", cfg.ple_vocab)])]
            out["per_layer_model_projection.weight"] = [
                layout((w, h), 0, [(f"{pre}per_layer_model_projection.weight", w)])]
            out["per_layer_projection_norm.weight"] = [
                layout((cfg.ple_dim,), 0, [(f"{pre}per_layer_projection_norm.weight", cfg.ple_dim)])]
        for i, layer in enumerate(self.layers):
            out.update(layer.layouts(f"layers.{i}", f"{pre}layers.{i}", cfg))
        out["norm.weight"] = [layout((h,), 0, [(f"{pre}norm.weight", h)])]
        if self.lm_head is not None:
            out["lm_head.weight"] = [layout((v, h), 0, [("lm_head.weight", v)])]
        out.update(self.kept.layouts("kept"))
        return out


NOTES = ("sliding + global layers (own head dims, proportional partial RoPE), KV-shared layers, per-layer embeddings, "
         "logit soft-capping; gemma4: text only (vision/audio towers kept opaque, saved untouched)")
for _type in ("gemma4_text", "gemma4"):
    register(_type, gemma4_config, Gemma4ForCausalLM,
             card=ModelCard("Gemma 4", ("dense", "moe"), tp="yes (MoE experts replicated)", routing_replay=True,
                           notes=NOTES))
