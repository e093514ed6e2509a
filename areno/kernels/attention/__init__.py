"""Attention kernels: packed varlen training/prefill (``packed``, with its ``tma`` and ``gluon`` variants built on
``common``), paged decode (``paged``), MLA latent decode (``mla``) and the q/k/v prologues (``prologue``,
``norm_rope``)."""

from areno.kernels.attention.mla import mla_decode, store_latent
from areno.kernels.attention.norm_rope import qk_norm_rope
from areno.kernels.attention.packed import attention
from areno.kernels.attention.paged import paged_attention, store_kvcache
from areno.kernels.attention.prologue import qkv_prologue

__all__ = ["attention", "mla_decode", "paged_attention", "qk_norm_rope", "qkv_prologue", "store_kvcache",
           "store_latent"]
