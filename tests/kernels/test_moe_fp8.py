"""FP8 routed experts (kernels/moe/fp8.py): stacked 128 x 128 block quantisation per expert, the native reference
against a float64 oracle built from the same codes, the Triton grouped kernels (interpreted) against the native one on
odd shapes (E not a power of two, N and K not multiples of 128, empty experts, one token, GeGLU), ``fused_moe``'s
dispatch on FP8 weights, refusals; bf16 at Qwen3-30B-A3B's expert widths on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from areno.kernels.fp8 import BLOCK, FP8, Fp8Weight, dequantize_weight_fp8, quantize_act_fp8_native, quantize_weight_fp8
from areno.kernels.moe.fp8 import fused_moe_fp8, fused_moe_fp8_native
from areno.kernels.moe.fused import fused_moe, fused_moe_reference


def _problem(T, E, H, I, k, dtype=torch.float32, used=None, seed=0, device="cpu"):
    """Random experts (per-expert magnitudes differ) and routing over ``used`` experts (default all but the last)."""
    g = torch.Generator().manual_seed(seed)
    used = torch.arange(E - 1) if used is None else torch.as_tensor(used)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5 * torch.rand(E, 1, 1, generator=g).add(0.5)
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5 * torch.rand(E, 1, 1, generator=g).add(0.5)
    ids = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g)
    return [t.to(device) for t in (x.to(dtype), w13, w2, w, ids)]


def _q(w13, w2):
    return quantize_weight_fp8(w13), quantize_weight_fp8(w2)


def _scales64(q: Fp8Weight) -> torch.Tensor:
    """Each element's block scale, float64 ``[E, N, K]``."""
    return q.scale.double().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, : q.shape[1], : q.shape[2]]


def _deq64(q: Fp8Weight) -> torch.Tensor:
    """Float64 dequantisation from the definition: code times its block's scale."""
    return q.qweight.double() * _scales64(q)


def _fake_quant64(t: torch.Tensor) -> torch.Tensor:
    xq, s = quantize_act_fp8_native(t)
    return xq.double() * s.double().repeat_interleave(BLOCK, 1)[:, : t.shape[1]]


def test_stacked_quantisation_is_per_expert_blocks():
    w = torch.randn(3, 200, 130) * torch.tensor([1.0, 1e-3, 50.0])[:, None, None]
    q = quantize_weight_fp8(w)
    assert q.qweight.shape == (3, 200, 130) and q.qweight.dtype == FP8 and q.scale.shape == (3, 2, 2)
    for e in range(3):  # each expert exactly as its own 2-D quantisation
        one = quantize_weight_fp8(w[e])
        assert torch.equal(q.qweight[e].view(torch.uint8), one.qweight.view(torch.uint8))
        assert torch.equal(q.scale[e], one.scale)
        assert torch.equal(dequantize_weight_fp8(q)[e], dequantize_weight_fp8(one))
    err = (dequantize_weight_fp8(q).double() - w.double()).abs()
    assert (err <= 2**-4 * w.double().abs() * (1 + 2**-20) + 2**-10 * _scales64(q)).all()  # 3 mantissa bits
    assert q.nbytes() == w.numel() + 3 * 2 * 2 * 4


def test_native_against_float64_from_the_same_codes():
    x, w13, w2, w, ids = _problem(9, E=5, H=200, I=72, k=2)
    q13, q2 = _q(w13, w2)
    y = fused_moe_fp8_native(x, q13, q2, w, ids)
    # the oracle in float64: x' and W' from the codes, g|u and h exact, h quantised per row (codes from its fp32)
    xs = _fake_quant64(x)
    W13, W2 = _deq64(q13), _deq64(q2)
    ref = torch.zeros(9, 200, dtype=torch.float64)
    for t in range(9):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (xs[t] @ W13[e].T).chunk(2)
            h = _fake_quant64((F.silu(gate) * up).float()[None])[0]
            ref[t] += float(w[t, j]) * (h @ W2[e].T)
    torch.testing.assert_close(y.double(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
    # and within the rounding of the unquantised product (each operand 2^-4 relative, h twice: about 10%)
    exact = fused_moe_reference(x.double(), w13.double(), w2.double(), w.double(), ids)
    assert (y.double() - exact).norm() <= 0.1 * exact.norm()


CASES = [  # (T, E, H, I, k, used): N and K not multiples of 128, E not a power of two, empty experts, one token
    (7, 5, 200, 72, 2, None), (1, 3, 130, 40, 1, None), (20, 6, 96, 136, 3, [0, 2, 5]), (33, 4, 64, 32, 1, [1]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,H,I,k,used", CASES)
def test_triton_matches_native(triton_kernels, T, E, H, I, k, used, dtype):
    x, w13, w2, w, ids = _problem(T, E, H, I, k, dtype, used=used, seed=T)
    q13, q2 = _q(w13, w2)
    y = fused_moe_fp8(x, q13, q2, w, ids)
    ref = fused_moe_fp8_native(x, q13, q2, w, ids)
    assert y.dtype == dtype and y.shape == (T, H)
    tol = 1e-5 if dtype == torch.float32 else 1e-4  # measured <= 5e-7 and 1.1e-5 of the largest output
    torch.testing.assert_close(y.double(), ref.double(), rtol=tol, atol=tol * ref.abs().max().item())


def test_triton_tiles_and_geglu(triton_kernels):
    """K of 3.3 groups walked in 128-wide steps, 64-row blocks, and Gemma 4's GeGLU activation."""
    x, w13, w2, w, ids = _problem(11, E=3, H=300, I=130, k=2, seed=4)
    q13, q2 = _q(w13, w2)
    cfg = dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=1)
    for act in ("silu", "gelu_tanh"):
        y = fused_moe_fp8(x, q13, q2, w, ids, activation=act, configs={"gate_up": cfg, "down": cfg})
        ref = fused_moe_fp8_native(x, q13, q2, w, ids, activation=act)
        # h (the activation between the two GEMMs) is quantised to E4M3: where the Triton and native gate_up sums
        # differ in their last bit across a rounding boundary, one element of h moves by an E4M3 step and its whole
        # output row by ~1e-4 of the largest output (measured 1.5e-4, on 7.6% of the elements, with numpy 2.4's
        # interpreter); a wrong tile or scale moves outputs by their own size
        big = ref.abs().max().item()
        torch.testing.assert_close(y, ref, rtol=0, atol=2e-3 * big)
        assert torch.isclose(y, ref, rtol=1e-5, atol=1e-5 * big).float().mean() >= 0.85


def test_fused_moe_dispatches_on_fp8_weights_and_refuses_gradients(native_kernels):
    x, w13, w2, w, ids = _problem(4, E=3, H=64, I=32, k=2)
    q13, q2 = _q(w13, w2)
    assert torch.equal(fused_moe(x, q13, q2, w, ids), fused_moe_fp8_native(x, q13, q2, w, ids))
    with pytest.raises(ValueError, match="inference-only"):
        fused_moe(x.requires_grad_(), q13, q2, w, ids)
    with torch.no_grad():
        assert fused_moe(x, q13, q2, w, ids, activation="gelu_tanh").shape == (4, 64)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, q13, q2, w, ids, activation="relu")
    with pytest.raises(AssertionError, match="scales"):
        fused_moe(x.detach(), q13, Fp8Weight(q2.qweight, torch.ones(3, 2, 1)), w, ids)


# ---------------------------------------------------------------------------------------------- GPU (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 256, 1024])  # 256: 2048 pairs, the decode config's edge; 1024: the large one
def test_triton_bf16_at_30b_a3b_expert_widths(T):
    """Qwen3-30B-A3B's experts (E=128, I=768: gate_up N = 2 x 768, K = 2048; down N = 2048, K = 768), top-8,
    bf16 activations, decode and prefill batch sizes: the Triton kernels against the native reference, and the
    quantised experts near the bf16 ones."""
    E, H, I, k = 128, 2048, 768, 8
    torch.manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    w, ids = torch.softmax(torch.randn(T, E, device="cuda"), -1).topk(k)
    ids = ids.to(torch.int32)
    q13, q2 = _q(w13, w2)
    with torch.no_grad():
        y = fused_moe(x, q13, q2, w, ids)
        ref = fused_moe_fp8_native(x, q13, q2, w, ids)
        bf16 = fused_moe(x, w13, w2, w, ids)
    assert y.dtype == torch.bfloat16 and y.shape == (T, H)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    assert (y.float() - bf16.float()).norm() <= 0.1 * bf16.float().norm()  # 0.064 measured in fp32 on CPU (E=16)
