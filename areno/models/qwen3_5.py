"""Qwen3.5 dense (``qwen3_5``, ``qwen3_5_text``) and MoE (``qwen3_5_moe``, ``qwen3_5_moe_text``): a hybrid of gated
delta net (linear attention) and gated full-attention layers; the layers and their equations are in
``qwen3_5_layers.py``. This module registers the four model types.

Checkpoints: the Hub's are the vision-language composite (``Qwen3_5ForConditionalGeneration``, model_type
``qwen3_5``/``qwen3_5_moe`` with a ``text_config``), whose decoder tensors are ``model.language_model.*``; the text-only
model types (``qwen3_5_text``, ``qwen3_5_moe_text``: ``Qwen3_5ForCausalLM``) name them ``model.*`` and load as the
text model (``qwen3_5_layers.Qwen35ForCausalLM``); the composite loads with its vision tower (``qwen3_5_vl.py``).
The multi-token-prediction layers (``mtp.*``, the drafts of speculative decoding) are loaded, kept frozen and
replicated, and saved untouched. MoE experts load from the per-expert names
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, what transformers writes); a checkpoint with fused expert tensors
(``mlp.experts.gate_up_proj``) is refused at load by the loader's missing/unknown-tensor check (not supported yet).

Tensor parallelism splits the gated delta net by heads (``in_proj_qkv`` and ``conv1d`` as three head-split slices
each: see ``GatedDeltaNet``); a TP size not dividing ``linear_num_key_heads`` is refused at load. In the rollout
engine the linear-attention layers keep a state slot per sequence (``recurrent_state_shapes``,
``areno/engine/state_cache.py``), the full attention layers the paged K/V cache.
"""

from __future__ import annotations

from areno.models.qwen3_5_layers import Qwen35ForCausalLM, check_qwen3_5, qwen3_5_config
from areno.models.qwen3_5_vl import Qwen35VLForConditionalGeneration, qwen3_5_vl_config
from areno.models.registry import ModelCard, register

TP = "must divide the linear (key) heads"
DENSE_CARD = ModelCard("Qwen3.5", ("hybrid", "vision"), tp=TP, mtp_kept=True,
                       notes="gated DeltaNet + gated attention; images through Qwen3-VL's tower (no DeepStack)")
MOE_CARD = ModelCard("Qwen3.5-MoE", ("hybrid", "moe", "vision"), tp=TP, routing_replay=True, mtp_kept=True,
                     notes="gated DeltaNet + gated attention, softmax top-k experts + gated shared expert; images")
register("qwen3_5", qwen3_5_vl_config, Qwen35VLForConditionalGeneration, check_config=check_qwen3_5, card=DENSE_CARD)
register("qwen3_5_text", qwen3_5_config, Qwen35ForCausalLM, card=DENSE_CARD)
register("qwen3_5_moe", qwen3_5_vl_config, Qwen35VLForConditionalGeneration, check_config=check_qwen3_5,
         card=MOE_CARD)
register("qwen3_5_moe_text", qwen3_5_config, Qwen35ForCausalLM, card=MOE_CARD)
