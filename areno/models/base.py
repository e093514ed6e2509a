"""The decoder every adapter shares: attention, dense MLP, decoder layer, the causal LM.

Pre-norm Llama layout (Qwen3 adds per-head q/k RMSNorm). Projections are fused (``qkv_proj``, ``gate_up_proj``);
``hf_layouts`` says which Hugging Face tensors each parameter is made of, for loading, saving and TP sharding.

Forward paths:
- training, packed varlen batch: ``model(input_ids [T], positions [T], cu_seqlens [B+1], max_seqlen) -> [T, H]``
  (final norm applied); log-probs come from ``model.token_logprobs`` (fused, no ``[T, V]`` logits).
- plain parity path: ``model.logits(input_ids [B, T]) -> [B, T, V]``.
- paged KV cache: ``model(input_ids, positions, kv_caches=[(k, v)] * L, attn_metadata=AttentionMetadata)``; the
  decode step has no host syncs or data-dependent shapes, so the engine can capture it in a CUDA graph. Under
  no-grad this path runs each layer's q/k norm, RoPE and cache write as one ``qkv_prologue`` launch. Training
  (no cache, grad mode on) runs them as ``qk_norm_rope``: one launch forward, one backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from areno.config.constants import ATTN_BACKENDS
from areno.kernels.activation import silu_and_mul, silu_and_mul_fp8
from areno.kernels.attention import attention
from areno.kernels.attention.norm_rope import qk_norm_rope
from areno.kernels.attention.paged import paged_attention, paged_kv, store_kvcache
from areno.kernels.attention.prologue import qkv_prologue
from areno.kernels.fp8 import fused_act_applies
from areno.kernels.logprobs.forward import linear_logprobs
from areno.kernels.rope import apply_rope, rope_cos_sin
from areno.models.attention_metadata import AttentionMetadata
from areno.models.layers import Linear, RMSNorm, VocabEmbedding, vocab_parallel_logits, with_fp8_act
from areno.models.model_config import ModelConfig
from areno.models.tp import layout


class Attention(nn.Module):
    # With a KV cache and grad mode off, run the fused qkv_prologue kernel; for training (no cache, grad mode on),
    # the differentiable qk_norm_rope. False keeps the separate split/norm/rope/store launches (the baseline for
    # parity tests and benchmarks).
    fused_prologue = True

    def __init__(self, cfg: ModelConfig, attn_backend: str = "flash"):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.qkv_proj = Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = d**-0.5
        self.backend = "native" if attn_backend == "native" else None
        self.window = None  # sliding-window size in keys (OLMo 3's sliding layers); None: full causal attention

    def shard_heads(self, rank: int, size: int) -> None:
        """Local head counts under TP (KV heads replicated when TP exceeds them)."""
        self.num_heads //= size
        self.num_kv_heads = max(1, self.num_kv_heads // size)

    def project_qkv(self, x):
        """The fused q/k/v projection ``[T, (Hq + 2 Hkv) D]`` (OLMo 2 also norms the whole q and k here)."""
        return self.qkv_proj(x)

    def qk_norm_weights(self, dtype):
        """The per-head q/k RMSNorm weights the fused kernels scale by (None, None without QK norm)."""
        return (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)

    def forward(self, x, positions, rope, meta: AttentionMetadata, kv_cache=None):
        q, k, v = self.prologue(self.project_qkv(x), positions, rope, meta, kv_cache)
        return self.o_proj(self.attend(q, k, v, meta, kv_cache).reshape(x.shape[0], -1))

    def prologue(self, qkv, positions, rope, meta: AttentionMetadata, kv_cache=None):
        """q/k norm, RoPE and the cache write of the fused projection ``qkv``: ``(q [T, Hq, D], k, v [T, Hkv, D])``."""
        t, d = qkv.shape[0], self.head_dim
        qn, kn = self.qk_norm_weights(qkv.dtype)
        eps = 1e-6 if self.q_norm is None else self.q_norm.eps
        fp8 = kv_cache is not None and len(kv_cache) == 4  # --kv-cache-dtype fp8: (k, v, k_scale, v_scale)
        if kv_cache is not None and self.fused_prologue and not torch.is_grad_enabled() and not fp8:
            # inference: q/k norm, RoPE and the cache write in one launch (local head counts under TP)
            q, k, v = qkv_prologue(
                qkv, positions, *rope, self.num_heads, self.num_kv_heads, d, qn, kn, eps, *kv_cache, meta.slot_mapping
            )
        elif self.fused_prologue and (fp8 and not torch.is_grad_enabled() or kv_cache is None and
                                      torch.is_grad_enabled()):
            # training: q/k norm and RoPE in one launch, their backward (and the split's) in one more; an FP8 cache:
            # that launch, then store_kvcache quantising on write (two launches instead of qkv_prologue's one)
            q, k, v = qk_norm_rope(qkv, positions, *rope, self.num_heads, self.num_kv_heads, d, qn, kn, eps)
            if fp8:
                k_cache, v_cache, scales = paged_kv(kv_cache)
                store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        else:
            q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, positions, *rope), apply_rope(k, positions, *rope)
            if kv_cache is not None:
                k_cache, v_cache, scales = paged_kv(kv_cache)
                store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        return q, k, v

    def attend(self, q, k, v, meta: AttentionMetadata, kv_cache=None, **extra):
        """Attention of the projected ``q/k/v [T, heads, D]``: packed (training, cache-free prefill) or against the
        paged cache (decode, prefill with a cached prefix). ``extra`` goes to the kernels (GPT-OSS: ``sinks``)."""
        if kv_cache is None:
            return attention(
                q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
                causal=True, softmax_scale=self.scale, backend=self.backend, window=self.window, **extra,
            )  # fmt: skip
        k_cache, v_cache, scales = paged_kv(kv_cache)  # an FP8 cache: the kernel dequantises with its scales
        if not meta.is_prefill:
            return paged_attention(q, k_cache, v_cache, meta.block_table, meta.seq_lens, softmax_scale=self.scale,
                                   window=self.window, split_rows=meta.split_rows, **scales, **extra)
        if meta.has_prefix:  # the cached prefix (and this chunk, just written) read back from the cache
            return paged_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, softmax_scale=self.scale,
                cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q, window=self.window, **scales, **extra,
            )  # fmt: skip
        return attention(
            q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            causal=True, softmax_scale=self.scale, backend=self.backend, window=self.window, **extra,
        )  # fmt: skip

    def layouts(self, name: str, hf: str, cfg: ModelConfig) -> dict:
        h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        rows = (hq + 2 * hkv) * d
        qkv = [(f"{hf}.q_proj.{{}}", hq * d, "plain", d)] + [(f"{hf}.{p}_proj.{{}}", hkv * d, "kv", d) for p in "kv"]
        out = {f"{name}.qkv_proj.weight": [layout((rows, h), 0, [(n.format("weight"), *r) for n, *r in qkv])]}
        out[f"{name}.o_proj.weight"] = [layout((h, hq * d), 1, [(f"{hf}.o_proj.weight", hq * d)])]
        if cfg.attention_bias:
            out[f"{name}.qkv_proj.bias"] = [layout((rows,), 0, [(n.format("bias"), *r) for n, *r in qkv])]
            out[f"{name}.o_proj.bias"] = [layout((h,), 0, [(f"{hf}.o_proj.bias", h)])]
        if cfg.qk_norm:
            for p in "qk":
                out[f"{name}.{p}_norm.weight"] = [layout((d,), 0, [(f"{hf}.{p}_norm.weight", d)])]
        return out


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one column-parallel GEMM."""

    has_router = False

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate_size = i = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * i, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias)

    def route(self, x, given=None):
        return ()

    def compute(self, x):
        h = self.gate_up_proj(x)
        if self.down_proj.fp8_on and fused_act_applies(h, h.shape[-1] // 2):  # FP8 rollout: one pass for both
            alone = self.down_proj.multiplies_act_alone(h)  # then the bf16 product is never written (nor read)
            y, act = silu_and_mul_fp8(h, keep_y=not alone)
            return self.down_proj(with_fp8_act(y, act, values=not alone))
        return self.down_proj(silu_and_mul(h))

    def forward(self, x):
        return self.compute(x)

    def layouts(self, name: str, hf: str, cfg: ModelConfig) -> dict:
        h, i = cfg.hidden_size, self.intermediate_size
        gate_up = lambda kind: [(f"{hf}.gate_proj.{kind}", i), (f"{hf}.up_proj.{kind}", i)]  # noqa: E731
        out = {
            f"{name}.gate_up_proj.weight": [layout((2 * i, h), 0, gate_up("weight"))],
            f"{name}.down_proj.weight": [layout((h, i), 1, [(f"{hf}.down_proj.weight", i)])],
        }
        if cfg.mlp_bias:
            out[f"{name}.gate_up_proj.bias"] = [layout((2 * i,), 0, gate_up("bias"))]
            out[f"{name}.down_proj.bias"] = [layout((h,), 0, [(f"{hf}.down_proj.bias", h)])]
        return out


class DecoderLayer(nn.Module):
    """Pre-norm block. With activation checkpointing the attention half and the MLP are recomputed in backward;
    a MoE router runs between the two recomputed regions, so routing (and its load counters) happens once."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module, attn_backend: str = "flash", attn: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, attn_backend) if attn is None else attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.checkpointing = False

    def attn_block(self, h, residual, positions, rope, meta, kv_cache=None):
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rope, meta, kv_cache)
        return self.post_attention_layernorm(h, residual)

    def _dense(self, h, residual, positions, rope, meta):
        h, residual = self.attn_block(h, residual, positions, rope, meta)
        return self.mlp.compute(h), residual

    def routed_block(self):
        """The layer's sparse-MoE block (``route``/``compute``, ``moe_index``), or None: the MLP when it routes."""
        return self.mlp if self.mlp.has_router else None

    def route(self, h, meta: AttentionMetadata):
        """A MoE layer's (weights, ids): replayed from ``meta.routing_in`` when given (weights from the current
        router), recorded into ``meta.routing_out`` when asked (see attention_metadata)."""
        moe = self.routed_block()
        if moe is None:
            return ()
        j = moe.moe_index
        weights, ids = moe.route(h, None if meta.routing_in is None else meta.routing_in[:, j])
        if meta.routing_out is not None:
            meta.routing_out[j, : ids.shape[0]].copy_(ids)
        return weights, ids

    def forward(self, h, residual, positions, rope, meta, kv_cache=None):
        recompute = self.checkpointing and kv_cache is None and torch.is_grad_enabled()
        if not recompute:
            h, residual = self.attn_block(h, residual, positions, rope, meta, kv_cache)
            return self.mlp.compute(h, *self.route(h, meta)), residual
        if not self.mlp.has_router:
            return checkpoint(self._dense, h, residual, positions, rope, meta, use_reentrant=False)
        h, residual = checkpoint(self.attn_block, h, residual, positions, rope, meta, use_reentrant=False)
        route = self.route(h, meta)
        return checkpoint(self.mlp.compute, h, *route, use_reentrant=False), residual


def training_metadata(input_ids, cu_seqlens=None, max_seqlen=None) -> AttentionMetadata:
    """Metadata of a plain (cache-free) forward over packed sequences: one sequence when ``cu_seqlens`` is None."""
    if cu_seqlens is None:
        t = input_ids.shape[0]
        cu_seqlens, max_seqlen = torch.tensor([0, t], dtype=torch.int32, device=input_ids.device), t
    elif max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return AttentionMetadata(None, True, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)


class CausalLM(nn.Module):
    """A decoder-only LM built from areno kernels. Parameters follow ``hf_layouts`` (Hugging Face names).

    Implements ``areno.models.protocol.ModelProtocol``: the capability facts below are its defaults (a dense,
    text-only, attention-only decoder); an adapter overrides those that differ."""

    is_value_model = False
    is_multimodal = False  # Qwen3-VL: a vision tower
    has_routing_bias = False  # bailing_hybrid: an MoE selection bias that update_routing_bias moves
    engine_support: str | None = None  # a reason the rollout engine cannot run the family (None: it can)
    kv_cache_layout: tuple | None = None  # None: K and V [num_kv_heads_local, kv_head_dim] a token
    hf_config: dict | None = None  # set by the loader
    source_dir = None  # set by the loader
    layer_class = DecoderLayer  # OLMo 2: its post-norm layer
    logit_softcap: float | None = None  # Gemma 4: logits are cap * tanh(logits / cap) (sampling and log-probs)

    def __init__(self, cfg: ModelConfig, *, attn_backend: str = "flash", mlp_factory=None, attn_factory=None):
        super().__init__()
        if attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"--attn-backend must be 'flash' or 'native', got {attn_backend!r}")
        self.config, self.attn_backend = cfg, attn_backend
        mlp_factory = mlp_factory or (lambda cfg, i: MLP(cfg))
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, mlp_factory(cfg, i), attn_backend, attn_factory(cfg, i) if attn_factory else None)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        routed = [layer.mlp for layer in self.layers if layer.mlp.has_router]
        for j, mlp in enumerate(routed):  # the row of each MoE layer in routing capture/replay tensors
            mlp.moe_index = j
        self.num_moe_layers = len(routed)
        self.moe_top_k = routed[0].top_k if routed else 0
        self.tp_group, self.tp_rank, self.tp_size = None, 0, 1
        self.activation_checkpointing = False
        self.rope = None  # (cos, sin) fp32 tables, built by init_buffers on the model's device

    # ---- sizes the engine allocates with -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def num_kv_heads_local(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def kv_head_dim(self) -> int:
        """Head dim of the paged K/V cache."""
        return self.head_dim

    @property
    def kv_cache_layers(self) -> list[int]:
        """The layers that keep K/V in the paged cache (all of them here; attention layers of a hybrid)."""
        return list(range(self.num_layers))

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window in keys (``config.sliding_window`` on ``config.sliding_layers``), None for
        full attention: the engine gives windowed layers their own KV-cache groups, which drop the blocks left of
        the window (``areno.engine.kv_cache.kv_groups``)."""
        cfg = self.config
        sliding = set(cfg.sliding_layers) if cfg.sliding_window is not None else set()
        return [cfg.sliding_window if i in sliding else None for i in range(self.num_layers)]

    def recurrent_state_shapes(self) -> dict | None:
        """Per-sequence state of recurrent layers for the engine (None: the model has none); see bailing_hybrid."""
        return None

    # ---- capabilities (areno.models.protocol) --------------------------------------------------------------
    @property
    def tie_word_embeddings(self) -> bool:
        return self.config.tie_word_embeddings

    @property
    def is_moe(self) -> bool:
        """Sparse-MoE layers: the engine can capture their routing and the trainer replay it."""
        return self.num_moe_layers > 0

    @property
    def is_hybrid(self) -> bool:
        """Recurrent layers: the engine keeps a state slot per running sequence."""
        return self.recurrent_state_shapes() is not None

    def update_routing_bias(self, rate: float, dp_group=None) -> None:
        raise NotImplementedError(f"{self.config.model_type} has no MoE selection bias (has_routing_bias is False)")

    def after_weight_update(self) -> None:
        """Called after new weights are copied in (policy sync): nothing derived from the weights to refresh here."""

    def encode_images(self, pixel_values, image_grid_thw):
        raise NotImplementedError(f"{self.config.model_type} has no vision tower (is_multimodal is False)")

    def freeze_media(self, *, tower: bool = True, projector: bool = True) -> None:
        """Freeze a media tower and projector: nothing to freeze without one."""

    def tower_parameters(self) -> list[nn.Parameter]:
        return []

    def projector_parameters(self) -> list[nn.Parameter]:
        return []

    def checkpoint_source(self, source):
        """The checkpoint's tensors as the layouts name them (GPT-OSS: MXFP4 experts dequantized); here as stored."""
        return source

    def keep_hf_tensor(self, hf_name: str) -> bool:
        """Whether a checkpoint tensor the layouts do not name is held opaque (``add_hf_tensor``): none here."""
        return False

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple:
        """Shape of one layer's ``k_cache`` (and ``v_cache``) on this rank."""
        return (num_blocks, block_size, self.num_kv_heads_local, self.kv_head_dim)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V_local, H]``: the LM head (the embedding when tied); this rank's vocab shard under TP."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def init_buffers(self, device=None) -> None:
        """Non-persistent state made on the real device after loading: RoPE tables, MoE load counters."""
        cfg = self.config
        device = device or self.embed_tokens.weight.device
        self.rope = rope_cos_sin(
            cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, rope_scaling=cfg.rope_scaling, device=device
        )
        for module in self.modules():
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers(device)

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        self.activation_checkpointing = enabled
        for layer in self.layers:
            layer.checkpointing = enabled

    # ---- forward paths -------------------------------------------------------------------------------------
    def forward(self, input_ids, positions, cu_seqlens=None, max_seqlen=None, *, kv_caches=None, attn_metadata=None,
                routed_experts=None):
        """Final hidden states ``[T, H]`` of a packed batch (or of the engine's step with ``kv_caches``).

        ``routed_experts`` int ``[T, num_moe_layers, k]`` (routing replay): the experts each token uses in each MoE
        layer (rows of -1 route as usual); the weights still come from the current router."""
        meta = self.step_metadata(input_ids, cu_seqlens, max_seqlen, attn_metadata, routed_experts)
        h, residual = self.embed_tokens(input_ids), None
        grouped = meta.layer_groups is not None  # KV-cache groups (sliding-window layers): each its own blocks
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, positions, self.rope, meta.for_layer(i) if grouped else meta,
                                None if kv_caches is None else kv_caches[i])
        return self.norm(h, residual)[0]

    def step_metadata(self, input_ids, cu_seqlens, max_seqlen, attn_metadata, routed_experts) -> AttentionMetadata:
        """The engine's metadata, or a packed batch's; with the replayed routes checked and attached."""
        meta = attn_metadata if attn_metadata is not None else training_metadata(input_ids, cu_seqlens, max_seqlen)
        if routed_experts is not None:
            if tuple(routed_experts.shape) != (input_ids.shape[0], self.num_moe_layers, self.moe_top_k):
                raise ValueError(f"routed_experts must be [T, num_moe_layers={self.num_moe_layers}, k="
                                 f"{self.moe_top_k}], got {tuple(routed_experts.shape)}")
            meta.routing_in = routed_experts
        return meta

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` logits in the model dtype (all-gathered over the vocab under TP)."""
        return vocab_parallel_logits(hidden, self.lm_head_weight, self.tp_group)

    def token_logprobs(self, hidden, targets, *, temperature=1.0, return_entropy=False, chunk_size=None):
        """fp32 ``log p(target)`` per row of ``hidden [N, H]`` without materialising logits (``-100`` -> 0)."""
        return linear_logprobs(
            hidden, self.lm_head_weight, targets, temperature=temperature, return_entropy=return_entropy,
            chunk_size=chunk_size, tp_group=self.tp_group,
        )  # fmt: skip

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` token ids (no padding) -> ``[B, T, V]`` logits: the plain path for parity checks."""
        b, t = input_ids.shape
        dev = input_ids.device
        positions = torch.arange(t, device=dev).repeat(b)
        cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=dev)
        hidden = self(input_ids.reshape(-1), positions, cu, t)
        return self.compute_logits(hidden).view(b, t, -1)

    # ---- weights -------------------------------------------------------------------------------------------
    def hf_layouts(self) -> dict:
        """``{param_name: [Layout]}``: how each (full, unsharded) parameter is made of Hugging Face tensors."""
        cfg = self.config
        h, v = cfg.hidden_size, cfg.vocab_size
        out = {"embed_tokens.weight": [layout((v, h), 0, [("model.embed_tokens.weight", v)])]}
        for i, layer in enumerate(self.layers):
            name, hf = f"layers.{i}", f"model.layers.{i}"
            out.update(layer.self_attn.layouts(f"{name}.self_attn", f"{hf}.self_attn", cfg))
            out.update(layer.mlp.layouts(f"{name}.mlp", f"{hf}.mlp", cfg))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"{name}.{norm}.weight"] = [layout((h,), 0, [(f"{hf}.{norm}.weight", h)])]
        out["norm.weight"] = [layout((h,), 0, [("model.norm.weight", h)])]
        if self.lm_head is not None:
            out["lm_head.weight"] = [layout((v, h), 0, [("lm_head.weight", v)])]
        return out
