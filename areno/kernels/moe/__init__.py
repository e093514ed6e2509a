"""Routed experts: ``fused_moe`` (``fused``, on the grouped GEMMs of ``gemm``) and the routers (``routing``)."""

from areno.kernels.moe.fused import fused_moe
from areno.kernels.moe.routing import expert_counts, route_sigmoid_grouped_topk, route_softmax_topk

__all__ = ["expert_counts", "fused_moe", "route_sigmoid_grouped_topk", "route_softmax_topk"]
