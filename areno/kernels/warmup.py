"""The install-time warm-up (``python -m areno.platform warmup``): every public Triton kernel once on small inputs.

Each recipe runs one public kernel (forward, and backward where training needs it) on small inputs. The shapes
compile the same kernels real models use for the dtype; other shape specialisations compile on first use.
"""

from __future__ import annotations

import os
import time

import torch

from areno.kernels.activation import silu_and_mul
from areno.kernels.attention import attention, paged_attention, qkv_prologue, store_kvcache
from areno.kernels.logprobs import linear_logprobs
from areno.kernels.moe import fused_moe
from areno.kernels.norm import rms_norm
from areno.kernels.rope import apply_rope, rope_cos_sin
from areno.kernels.sampler import sample


def _warm_attention(dev, dt):
    q, k, v = (torch.randn(16, h, 64, device=dev, dtype=dt, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device=dev)
    attention(q, k, v, cu, cu, 9, 9, causal=True).float().sum().backward()


def _warm_paged_attention(dev, dt):
    q = torch.randn(2, 4, 64, device=dev, dtype=dt)
    k_cache, v_cache = torch.zeros(4, 16, 2, 64, device=dev, dtype=dt), torch.zeros(4, 16, 2, 64, device=dev, dtype=dt)
    k, v = torch.randn(25, 2, 64, device=dev, dtype=dt), torch.randn(25, 2, 64, device=dev, dtype=dt)
    slots = torch.cat([torch.arange(0, 20), torch.arange(32, 37)]).to(device=dev, dtype=torch.int64)
    store_kvcache(k, v, k_cache, v_cache, slots)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev)
    paged_attention(q, k_cache, v_cache, block_table, torch.tensor([20, 5], dtype=torch.int32, device=dev))


def _warm_qkv_prologue(dev, dt):
    cos, sin = rope_cos_sin(64, 32, 10000.0, device=dev)
    qkv = torch.randn(16, 8 * 64, device=dev, dtype=dt)
    k_cache, v_cache = torch.zeros(4, 16, 2, 64, device=dev, dtype=dt), torch.zeros(4, 16, 2, 64, device=dev, dtype=dt)
    norm_w = torch.ones(64, device=dev, dtype=dt)
    slots = torch.arange(16, device=dev)
    with torch.no_grad():
        for w in (norm_w, None):  # Qwen3 (q/k norm) and Llama (none) variants
            qkv_prologue(qkv, slots, cos, sin, 4, 2, 64, w, w, 1e-6, k_cache, v_cache, slots)


def _warm_linear_logprobs(dev, dt):
    hidden = torch.randn(8, 64, device=dev, dtype=dt, requires_grad=True)
    weight = torch.randn(256, 64, device=dev, dtype=dt, requires_grad=True)
    targets = torch.randint(0, 256, (8,), device=dev)
    logprobs, entropy = linear_logprobs(hidden, weight, targets, return_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()


def _warm_fused_moe(dev, dt):
    x = torch.randn(8, 64, device=dev, dtype=dt, requires_grad=True)
    w13 = (torch.randn(4, 64, 64, device=dev, dtype=dt) / 8).requires_grad_()
    w2 = (torch.randn(4, 64, 32, device=dev, dtype=dt) / 8).requires_grad_()
    topk_weights = torch.rand(8, 2, device=dev).softmax(-1).to(dt).requires_grad_()
    topk_ids = torch.randint(0, 4, (8, 2), device=dev)
    fused_moe(x, w13, w2, topk_weights, topk_ids).float().sum().backward()


def _warm_rms_norm(dev, dt):
    x = torch.randn(8, 64, device=dev, dtype=dt, requires_grad=True)
    weight = torch.ones(64, device=dev, dtype=dt, requires_grad=True)
    rms_norm(x, weight).float().sum().backward()
    rms_norm(x.detach(), weight.detach(), residual=torch.randn_like(x.detach()))


def _warm_apply_rope(dev, dt):
    cos, sin = rope_cos_sin(64, 32, 10000.0, device=dev)
    x = torch.randn(16, 4, 64, device=dev, dtype=dt, requires_grad=True)
    apply_rope(x, torch.arange(16, device=dev), cos, sin).float().sum().backward()


def _warm_silu_and_mul(dev, dt):
    silu_and_mul(torch.randn(8, 128, device=dev, dtype=dt, requires_grad=True)).float().sum().backward()


def _warm_sample(dev, dt):
    logits = torch.randn(4, 256, device=dev, dtype=torch.float32)
    seeds, offsets = torch.arange(4, device=dev), torch.zeros(4, dtype=torch.int64, device=dev)
    sample(logits, temperature=0.7, seeds=seeds, offsets=offsets)
    sample(logits, temperature=0.7, seeds=seeds, offsets=offsets, top_k=50, top_p=0.9)


WARMUP = {
    "attention": _warm_attention,
    "paged_attention": _warm_paged_attention,
    "qkv_prologue": _warm_qkv_prologue,
    "linear_logprobs": _warm_linear_logprobs,
    "fused_moe": _warm_fused_moe,
    "rms_norm": _warm_rms_norm,
    "apply_rope": _warm_apply_rope,
    "silu_and_mul": _warm_silu_and_mul,
    "sample": _warm_sample,
}


def warmup(device: str = "cuda") -> dict[str, str]:
    """Run each public Triton kernel once on small tensors so that Triton compiles and caches it (in ~/.triton or
    $TRITON_CACHE_DIR). Returns kernel name -> outcome.

    ``device="cpu"`` runs the same recipes in the Triton interpreter (TRITON_INTERPRET=1, fp32): a test of them."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("warmup needs a CUDA device (the CPU path uses native PyTorch: nothing to build)")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("warmup on the CPU needs TRITON_INTERPRET=1, set before triton is imported")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 arithmetic is wrong in the interpreter
    saved = os.environ.get("ARENO_KERNELS")
    os.environ["ARENO_KERNELS"] = "triton"  # compile the Triton path even where auto dispatch would not
    results = {}
    try:
        for name, recipe in WARMUP.items():
            t0 = time.perf_counter()
            try:
                recipe(device, dtype)
                if device == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:
                results[name] = f"failed: {type(e).__name__}: {e}"
            else:
                results[name] = f"ok ({time.perf_counter() - t0:.1f} s)"
    finally:
        if saved is None:
            os.environ.pop("ARENO_KERNELS", None)
        else:
            os.environ["ARENO_KERNELS"] = saved
    return results
