"""Tiny random Hugging Face checkpoints and the tiny byte-level BPE tokenizer, for the quickstart preset, benches,
examples and tests (helpers only tests use live in ``tests/helpers``).

Offline by construction: the tokenizer is trained on text generated here (``corpus``) and committed as
``tokenizer.json``; the weights are drawn from a seeded generator. transformers, tokenizers and safetensors are
imported only when a function needs them.
"""

from areno.testing.checkpoints import FAMILIES, make_tiny_checkpoint, random_weights, tiny_config, weight_shapes
from areno.testing.tokenizer import CHAT_TEMPLATE, VOCAB_SIZE, load_tokenizer, train_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "VOCAB_SIZE",
    "load_tokenizer",
    "make_tiny_checkpoint",
    "random_weights",
    "tiny_config",
    "train_tokenizer",
    "weight_shapes",
]
