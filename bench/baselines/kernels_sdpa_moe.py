"""Baseline kernels in plain torch: SDPA attention (K1) and a mixture-of-experts layer (K3), fwd and fwd+bwd.

    python bench/baselines/kernels_sdpa_moe.py            # K1 and K3 on the GPU
    python bench/baselines/kernels_sdpa_moe.py K3         # one of them
    python bench/baselines/kernels_sdpa_moe.py --smoke    # CPU: tiny sizes, the math backend (times meaningless)

K1: ``torch.nn.functional.scaled_dot_product_attention``, causal, bf16, batch 8, 16 query / 8 KV heads (GQA),
head dim 128, at 1k / 4k / 8k tokens, once per backend (flash, cuDNN, memory-efficient; a backend that refuses the
shape prints its error). TFLOP/s count the causal half: forward 2 x 2 x B x H x L^2 x D / 2, backward 2.5x that.
K3: Qwen3-30B-A3B's expert shape (128 experts, top-8, hidden 2048, expert intermediate 768, SwiGLU), random router,
at 1k / 8k / 32k tokens, two ways: a loop over experts as ``transformers`` runs it, and the tokens sorted by expert
through two ``torch._grouped_mm`` calls. Median of CUDA-event timings (``bench/common.py``'s ``gpu_time_ms``).
``bench/attention.py`` and ``bench/moe.py`` time the same baselines beside areno's kernels in their own run.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.baselines.common import run_parts  # noqa: E402
from bench.common import gpu_time_ms  # noqa: E402


def _grad_free(*tensors):
    for t in tensors:
        t.grad = None


def k1(device: str, dtype, smoke: bool):
    batch, heads_q, heads_kv, head_dim = (1, 4, 2, 16) if smoke else (8, 16, 8, 128)
    seqs = (64,) if smoke else (1024, 4096, 8192)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.MATH] if smoke else [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                                SDPBackend.EFFICIENT_ATTENTION]  # fmt: skip
    for seq in seqs:
        q = torch.randn(batch, heads_q, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(batch, heads_kv, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))  # fmt: skip
        grad_out = torch.randn_like(q)
        fwd_flop = 2 * 2 * batch * heads_q * seq * seq * head_dim / 2
        for backend in backends:
            rec = {"workload": "K1", "impl": f"sdpa {backend.name.lower()}", "seq": seq, "batch": batch}
            try:
                with sdpa_kernel(backend):
                    fwd_ms, fwdbwd_ms = _time_fwd_and_train(_sdpa(q, k, v), grad_out, (q, k, v), iters=10)
                rec.update(fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms, fwd_tflops=fwd_flop / fwd_ms / 1e9,
                           fwdbwd_tflops=3.5 * fwd_flop / fwdbwd_ms / 1e9)  # fmt: skip
            except Exception as e:  # the backend does not take this shape or GPU: say so, go on
                rec["error"] = f"{type(e).__name__}: {e}"[:200]
            yield rec


def _sdpa(q, k, v):
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _time_fwd_and_train(forward, grad_out, leaves, *, iters: int, warmup: int = 3) -> tuple[float, float]:
    """Median ms of ``forward()`` without autograd, then of forward + backward (the leaves' gradients dropped)."""

    def train():
        forward().backward(grad_out)
        _grad_free(*leaves)

    with torch.no_grad():
        fwd_ms = gpu_time_ms(forward, warmup=warmup, iters=iters)
    return fwd_ms, gpu_time_ms(train, warmup=warmup, iters=iters)


def _experts_by_loop(x, w_gate_up, w_down, weights, experts):
    """Each expert takes its tokens in turn (transformers' MoE block)."""
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    for e in range(w_gate_up.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel():
            gate_up = x[token] @ w_gate_up[e].T
            y = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w_down[e].T
            out = out.index_add(0, token, y * weights[token, slot].unsqueeze(1))
    return out


def _experts_grouped(x, w_gate_up, w_down, weights, experts):
    """Tokens sorted by expert, then one grouped GEMM per projection."""
    inter, top_k = w_down.shape[2], experts.shape[1]
    order = experts.reshape(-1).argsort()
    token = order // top_k
    ends = torch.bincount(experts.reshape(-1), minlength=w_gate_up.shape[0]).cumsum(0).to(torch.int32)
    gate_up = torch._grouped_mm(x[token], w_gate_up.transpose(1, 2), offs=ends)
    y = torch._grouped_mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down.transpose(1, 2), offs=ends)
    return torch.zeros_like(x).index_add(0, token, y * weights.reshape(-1)[order].unsqueeze(1))


def k3(device: str, dtype, smoke: bool):
    n_experts, top_k, hidden, inter = (8, 2, 32, 16) if smoke else (128, 8, 2048, 768)
    token_counts = (64,) if smoke else (1024, 8192, 32768)
    gen = torch.Generator(device=device).manual_seed(0)
    w_gate_up = (0.02 * torch.randn(n_experts, 2 * inter, hidden, device=device, generator=gen)).to(dtype)
    w_down = (0.02 * torch.randn(n_experts, hidden, inter, device=device, generator=gen)).to(dtype)
    w_gate_up.requires_grad_()
    w_down.requires_grad_()
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen, requires_grad=True)
        probs = torch.randn(tokens, n_experts, device=device, generator=gen).softmax(-1)
        weights, experts = probs.topk(top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        grad_out = torch.randn_like(x)
        fwd_flop = 2 * tokens * top_k * hidden * 3 * inter
        for impl, layer in (("loop", _experts_by_loop), ("grouped_mm", _experts_grouped)):
            rec = {"workload": "K3", "impl": impl, "tokens": tokens, "experts": n_experts, "top_k": top_k}
            forward = functools.partial(layer, x, w_gate_up, w_down, weights, experts)
            try:
                fwd_ms, fwdbwd_ms = _time_fwd_and_train(forward, grad_out, (x, w_gate_up, w_down), iters=5, warmup=2)
                rec.update(fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms, fwd_tflops=fwd_flop / fwd_ms / 1e9,
                           fwdbwd_tflops=3 * fwd_flop / fwdbwd_ms / 1e9)  # fmt: skip
            except Exception as e:  # e.g. _grouped_mm without a GPU that has it
                rec["error"] = f"{type(e).__name__}: {e}"[:200]
            yield rec


def main(argv=None) -> None:
    dtype = lambda device: torch.float32 if device == "cpu" else torch.bfloat16  # noqa: E731
    parts = {"K1": lambda a, device: k1(device, dtype(device), a.smoke),
             "K3": lambda a, device: k3(device, dtype(device), a.smoke)}  # fmt: skip
    run_parts(__doc__, parts, argv)


if __name__ == "__main__":
    main()
