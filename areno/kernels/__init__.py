"""areno's kernels: Triton kernels, native PyTorch references, autograd Functions and one dispatch point each.

The public functions (contracts in docs/design.md) are bound here after their modules are imported, so that a name such
as ``areno.kernels.attention`` is always the function even though a submodule of the same name exists.
"""

from areno.kernels import activation as _activation
from areno.kernels import attention as _attention
from areno.kernels import linear_logprobs as _linear_logprobs
from areno.kernels import linear_logprobs_loss as _linear_logprobs_loss
from areno.kernels import moe as _moe
from areno.kernels import paged_attention as _paged_attention
from areno.kernels import penalties as _penalties
from areno.kernels import qk_norm_rope as _qk_norm_rope
from areno.kernels import qkv_prologue as _qkv_prologue
from areno.kernels import rms_norm as _rms_norm
from areno.kernels import rope as _rope
from areno.kernels import sampler as _sampler

attention = _attention.attention
paged_attention = _paged_attention.paged_attention
store_kvcache = _paged_attention.store_kvcache
qkv_prologue = _qkv_prologue.qkv_prologue
qk_norm_rope = _qk_norm_rope.qk_norm_rope
rms_norm = _rms_norm.rms_norm
apply_rope = _rope.apply_rope
rope_cos_sin = _rope.rope_cos_sin
rope_params_from_config = _rope.rope_params_from_config
silu_and_mul = _activation.silu_and_mul
linear_logprobs = _linear_logprobs.linear_logprobs
linear_logprobs_loss = _linear_logprobs_loss.linear_logprobs_loss
sample = _sampler.sample
apply_penalties = _penalties.apply_penalties
apply_logit_bias = _penalties.apply_logit_bias
fused_moe = _moe.fused_moe
route_softmax_topk = _moe.route_softmax_topk
route_sigmoid_grouped_topk = _moe.route_sigmoid_grouped_topk

__all__ = [
    "apply_logit_bias", "apply_penalties", "apply_rope", "attention", "fused_moe", "linear_logprobs",
    "linear_logprobs_loss", "paged_attention", "qkv_prologue", "rms_norm", "rope_cos_sin", "rope_params_from_config",
    "route_sigmoid_grouped_topk", "route_softmax_topk", "sample", "silu_and_mul", "store_kvcache",
]
