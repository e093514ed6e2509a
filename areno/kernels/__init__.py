"""areno's kernels: Triton kernels, native PyTorch references, autograd Functions and one dispatch point each.

Public functions (contracts in DESIGN.md) are imported lazily so that ``import areno.kernels`` stays cheap.
"""

import importlib

_PUBLIC = {
    "attention": "attention",
    "paged_attention": "paged_attention",
    "store_kvcache": "paged_attention",
    "rms_norm": "rms_norm",
    "apply_rope": "rope",
    "rope_cos_sin": "rope",
    "silu_and_mul": "activation",
    "linear_logprobs": "linear_logprobs",
    "sample": "sampler",
    "fused_moe": "moe",
    "route_softmax_topk": "moe",
    "route_sigmoid_grouped_topk": "moe",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        module = importlib.import_module(f"areno.kernels.{_PUBLIC[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'areno.kernels' has no attribute {name!r}")
