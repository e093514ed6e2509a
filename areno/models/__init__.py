"""areno.models: adapters (qwen3, qwen3_moe, llama, bailing_hybrid, qwen3_vl), Hugging Face load/save, TP sharding.

Entry points (docs/design.md): ``load_model(path_or_repo_id, *, dtype=None, device=None, tp_group=None,
attn_backend=None, quantize_base=None)`` (``"nf4"``: QLoRA's base quantised as it loads),
``load_tokenizer(path_or_repo_id)``, ``save_model(model, dir, tokenizer=None)`` and ``model.logits(input_ids [B, T])
-> [B, T, V]``. What the engine and the trainer may call and read on a model is declared in ``protocol.py``
(``ModelProtocol``, ``TrainedModel``).
"""

from areno.models.attention_metadata import AttentionMetadata
from areno.models.loader import load_hf_weights, load_model, load_tokenizer, resolve_model_path
from areno.models.protocol import ModelProtocol, TrainedModel
from areno.models.registry import MODEL_REGISTRY, get_adapter, register
from areno.models.saver import iter_hf_tensors, save_model

__all__ = [
    "MODEL_REGISTRY",
    "AttentionMetadata",
    "ModelProtocol",
    "TrainedModel",
    "get_adapter",
    "iter_hf_tensors",
    "load_hf_weights",
    "load_model",
    "load_tokenizer",
    "register",
    "resolve_model_path",
    "save_model",
]
