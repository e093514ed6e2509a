"""areno's kernels: Triton kernels, native PyTorch references, autograd Functions and one dispatch point each.

One subpackage or module per family (docs/kernels.md lists them, their variants and defaults): ``attention``
(packed varlen, paged decode, MLA decode, the q/k/v prologues), ``logprobs`` (LM-head log-probs and their loss),
``moe``, ``linear_attn`` (gated delta rule, short convolution) and the flat modules ``norm``, ``rope``,
``activation``, ``gemm``, ``sampler``, ``penalties``, ``adamw``; ``dispatch`` picks Triton or native PyTorch,
``warmup`` compiles the kernels at install time. Import a function from its family, e.g.
``from areno.kernels.attention import attention``; this package binds no names over its submodules.
"""
