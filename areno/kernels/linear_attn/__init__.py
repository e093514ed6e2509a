"""Linear-attention layers' kernels: the gated delta rule (``delta_rule``) and the causal short convolution
(``short_conv``)."""

from areno.kernels.linear_attn.delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule_step
from areno.kernels.linear_attn.short_conv import causal_conv1d, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule_step"]
