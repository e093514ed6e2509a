"""fused_moe (Triton under the interpreter on CPU, native loop) against a float64 oracle: output and all four grads."""

import pytest
import torch

from areno.kernels.moe.fused import (
    fused_moe,
    fused_moe_native,
    fused_moe_reference,
    route_softmax_topk,
    sort_by_expert,
)

TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _seeded():
    """Each test draws from its own seed, not from whatever state earlier tests left: dtopk_weights is a 64-term dot
    product (an fp16 draw with cancellation once measured 3% from float64 under the 1% bar)."""
    torch.manual_seed(0)


def _problem(T, E, H, I, k, dtype, device="cpu", used=None):
    """Random experts and routing; only experts in ``used`` (default: all but the last two) receive tokens."""
    used = torch.arange(E - 2) if used is None else torch.as_tensor(used)
    x = torch.randn(T, H, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(dtype)
    ids = torch.stack([used[torch.randperm(len(used))[:k]] for _ in range(T)]).to(device=device, dtype=torch.int32)
    w = torch.rand(T, k, device=device)
    return x, w13, w2, w, ids


def _rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def _fwd_bwd(fn, x, w13, w2, w, ids, dy, dtype=None):
    leaves = [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in (x, w13, w2, w)]
    y = fn(*leaves, ids)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


def _check_against_oracle(fn, problem, tol):
    x, w13, w2, w, ids = problem
    dy = torch.randn(x.shape, device=x.device)
    y, grads = _fwd_bwd(fn, x, w13, w2, w, ids, dy.to(x.dtype))
    y_ref, grads_ref = _fwd_bwd(fused_moe_reference, x, w13, w2, w, ids, dy, torch.float64)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert _rel_err(y, y_ref) < tol, f"output: {_rel_err(y, y_ref)}"
    for name, g, g_ref, leaf in zip(("x", "w13", "w2", "topk_weights"), grads, grads_ref, (x, w13, w2, w)):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        assert _rel_err(g, g_ref) < tol, f"d{name}: {_rel_err(g, g_ref)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_triton_matches_float64(triton_kernels, T, dtype):
    _check_against_oracle(fused_moe, _problem(T, E=8, H=64, I=32, k=2, dtype=dtype), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_loop_matches_float64(native_kernels, dtype):
    _check_against_oracle(fused_moe, _problem(33, E=8, H=64, I=32, k=2, dtype=dtype), TOL[dtype])


def test_skewed_routing_odd_sizes_half_weights(triton_kernels):
    """k=1, every token on one expert (segments spanning several blocks), odd H/I, fp16 routing weights."""
    x, w13, w2, w, ids = _problem(37, E=5, H=40, I=24, k=1, dtype=torch.float32, used=[3])
    _check_against_oracle(fused_moe, (x, w13, w2, w.half(), ids), 2e-3)


def test_deterministic_and_no_grad_path(triton_kernels):
    x, w13, w2, w, ids = _problem(21, E=8, H=64, I=32, k=3, dtype=torch.float16)
    dy = torch.randn(x.shape).half()
    y1, g1 = _fwd_bwd(fused_moe, x, w13, w2, w, ids, dy)
    y2, g2 = _fwd_bwd(fused_moe, x, w13, w2, w, ids, dy)
    with torch.no_grad():
        y3 = fused_moe(x, w13, w2, w, ids)
    for a, b in zip([y1, *g1, y3], [y2, *g2, y1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_matches_transformers_qwen3_moe_block(triton_kernels):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    hidden = torch.randn(1, 13, 64)
    with torch.no_grad():
        ref = block(hidden)[0]
        logits = hidden[0] @ block.gate.weight.T
        w, ids, _ = route_softmax_topk(logits, 2)
        y = fused_moe(hidden[0], block.experts.gate_up_proj, block.experts.down_proj, w, ids)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)


def test_sort_by_expert_layout():
    ids = torch.randint(0, 6, (19, 3), dtype=torch.int32)
    ids[:, 0] = 2  # many ties: the sort must keep pair order inside an expert
    order, counts = sort_by_expert(ids, 8)
    flat = ids.reshape(-1)
    assert order.dtype == torch.int32 and counts.dtype == torch.int32
    assert (flat[order.long()].diff() >= 0).all()
    for e in range(8):
        pairs = order[flat[order.long()] == e]
        assert (pairs.diff() > 0).all()
    torch.testing.assert_close(counts, torch.bincount(flat.long(), minlength=8).int(), rtol=0, atol=0)


def test_rejects_other_activations_and_bad_shapes():
    x, w13, w2, w, ids = _problem(3, E=4, H=16, I=8, k=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="silu"):
        fused_moe(x, w13, w2, w, ids, activation="gelu")
    with pytest.raises(AssertionError, match="w2"):
        fused_moe(x, w13, w2.transpose(1, 2), w, ids)


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16 at Qwen3-30B-A3B's expert shape; the oracle is the per-expert loop in float64.

def _gpu_problem(T, seed):
    torch.manual_seed(seed)
    return _problem(T, E=128, H=2048, I=768, k=8, dtype=torch.bfloat16, device="cuda", used=torch.arange(120))


def _gpu_oracle(x, w13, w2, w, ids, dy):
    return _fwd_bwd(fused_moe_native, x, w13, w2, w, ids, dy, torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 256, 3001])
def test_gpu_bf16_qwen3_30b_shape(T):
    x, w13, w2, w, ids = _gpu_problem(T, seed=T)
    dy = torch.randn(x.shape, device="cuda")
    y, grads = _fwd_bwd(fused_moe, x, w13, w2, w, ids, dy.bfloat16())
    y_ref, grads_ref = _gpu_oracle(x, w13, w2, w, ids, dy)
    assert _rel_err(y, y_ref) < TOL[torch.bfloat16], _rel_err(y, y_ref)
    for name, g, g_ref in zip(("x", "w13", "w2", "topk_weights"), grads, grads_ref):
        assert _rel_err(g, g_ref) < TOL[torch.bfloat16], (name, _rel_err(g, g_ref))
    # empty experts get exactly zero weight grads
    assert grads[1][120:].abs().max().item() == 0 and grads[2][120:].abs().max().item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 256])
def test_gpu_decode_forward_no_grad(T):
    x, w13, w2, w, ids = _gpu_problem(T, seed=100 + T)
    with torch.no_grad():
        y = fused_moe(x, w13, w2, w, ids)
        ref = fused_moe_native(x.double(), w13.double(), w2.double(), w.double(), ids)
    assert _rel_err(y, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_routing_then_experts_bf16():
    torch.manual_seed(0)
    x, w13, w2, _, _ = _gpu_problem(512, seed=1)
    logits = (x @ torch.randn(2048, 128, device="cuda", dtype=torch.bfloat16) * 0.05).float()
    w, ids, counts = route_softmax_topk(logits, 8)
    assert int(counts.sum()) == 512 * 8
    with torch.no_grad():
        y = fused_moe(x, w13, w2, w, ids)
        ref = fused_moe_native(x.double(), w13.double(), w2.double(), w.double(), ids)
    assert _rel_err(y, ref) < TOL[torch.bfloat16]
