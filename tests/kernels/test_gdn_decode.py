"""Qwen3.5's fused gated-DeltaNet decode step (areno/kernels/linear_attn/gdn_decode.py): the Triton kernel against the
layer's unfused path (native) and a float64 oracle, outputs and the state pool, over odd shapes (value heads sharing
key heads, value dims that are not a power of two, several value blocks, skipped rows, permuted slots)."""

import pytest
import torch

from areno.kernels.linear_attn import gdn_decode
from areno.kernels.linear_attn.gdn_decode import (
    gated_rms_norm_silu,
    gated_rms_norm_silu_native,
    gdn_decode_step,
    gdn_decode_step_native,
    gdn_verify_steps,
)
from areno.kernels.linear_attn.steps import VerifyInputs
from tests.helpers.timing import cuda_ms

CASES = [  # (B, nk, nv, dk, dv)
    (3, 2, 4, 16, 24),  # two value heads per key head, dv masked in one block
    (2, 1, 1, 8, 40),  # three value blocks at BV = 16, the last masked
    (5, 3, 3, 32, 16),  # nv == nk
]


def _inputs(B, nk, nv, dk, dv, dtype, seed, slots=8):
    """qkv (the conv output), a and b as strided views of one projection row (as the layer's split gives them), the
    decay parameters, a state pool and each row's slot (permuted; the middle row skipped, -1)."""
    g = torch.Generator().manual_seed(seed)
    cols = 2 * nk * dk + nv * dv
    proj = torch.randn(B, cols + 2 * nv, generator=g)
    proj[:, cols : cols + nv] *= 8.0  # a: reach softplus' linear and exponential ends
    proj = proj.to(dtype)
    qkv, a, b = proj[:, :cols].contiguous(), proj[:, cols : cols + nv], proj[:, cols + nv :]
    A_log = torch.randn(nv, generator=g) * 0.5
    dt_bias = torch.randn(nv, generator=g)
    pool = torch.randn(slots, nv, dk, dv, generator=g) * 0.3
    idx = torch.randperm(slots, generator=g)[:B].to(torch.int32)
    idx[B // 2] = -1
    return qkv, a, b, A_log, dt_bias, pool, idx


@pytest.mark.parametrize("bv", [None, 16], ids=["default_tile", "bv16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B,nk,nv,dk,dv", CASES)
def test_triton_matches_native_and_float64(B, nk, nv, dk, dv, dtype, bv, triton_kernels, monkeypatch):
    if bv:  # value columns split over several programs, the last one masked where dv is not a multiple
        monkeypatch.setitem(gdn_decode.STEP_CONFIG, torch.float32, {"BV": bv, "num_warps": 2})
    qkv, a, b, A_log, dt_bias, pool, idx = _inputs(B, nk, nv, dk, dv, dtype, seed=B * 100 + nv * 10 + dk)
    kw = dict(num_k_heads=nk, num_v_heads=nv, state_indices=idx)
    state = pool.clone()
    o = gdn_decode_step(qkv, a, b, A_log, dt_bias, state, **kw)
    ref_state = pool.clone()
    ref = gdn_decode_step_native(qkv, a, b, A_log, dt_bias, ref_state, **kw)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(o, ref, **tol)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)
    # float64 oracle: the same math on inputs rounded as the kernel sees them
    d_state = pool.double()
    oracle = gdn_decode_step_native(qkv.double(), a.double(), b.double(), A_log.double(), dt_bias.double(), d_state,
                                    **kw)  # fmt: skip
    o_tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(o.double(), oracle, **o_tol)
    torch.testing.assert_close(state.double(), d_state, **o_tol)
    assert (o[B // 2] == 0).all()  # the skipped row
    untouched = sorted(set(range(pool.shape[0])) - set(idx.tolist()))
    assert torch.equal(state[untouched], pool[untouched])


def test_without_a_pool_the_state_is_the_batch(triton_kernels):
    qkv, a, b, A_log, dt_bias, pool, _ = _inputs(3, 2, 4, 16, 24, torch.float32, seed=7, slots=3)
    state, ref_state = pool.clone(), pool.clone()
    o = gdn_decode_step(qkv, a, b, A_log, dt_bias, state, num_k_heads=2, num_v_heads=4)
    ref = gdn_decode_step_native(qkv, a, b, A_log, dt_bias, ref_state, num_k_heads=2, num_v_heads=4)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_bf16_state_pool_math_in_fp32(dtype, triton_kernels):
    """A bf16 state pool (half the bytes a decode step moves): read and written in bf16, the step's math in fp32;
    the kernel and the native path agree, and both stay within bf16 rounding of the fp32 pool's result."""
    qkv, a, b, A_log, dt_bias, pool, idx = _inputs(5, 3, 3, 32, 16, dtype, seed=11)
    kw = dict(num_k_heads=3, num_v_heads=3, state_indices=idx)
    state, ref_state, full = pool.bfloat16(), pool.bfloat16(), pool.bfloat16().float()
    o = gdn_decode_step(qkv, a, b, A_log, dt_bias, state, **kw)
    ref = gdn_decode_step_native(qkv, a, b, A_log, dt_bias, ref_state, **kw)
    o32 = gdn_decode_step_native(qkv, a, b, A_log, dt_bias, full, **kw)
    assert state.dtype == ref_state.dtype == torch.bfloat16
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(o, ref, **tol)
    torch.testing.assert_close(o, o32, **tol)  # the output is computed before the state is rounded
    torch.testing.assert_close(state.float(), ref_state.float(), atol=1e-2, rtol=8e-3)  # one bf16 ulp apart at most
    torch.testing.assert_close(state.float(), full, atol=1e-2, rtol=8e-3)


def test_bad_shapes_name_the_mismatch():
    qkv, a, b, A_log, dt_bias, pool, idx = _inputs(3, 2, 4, 16, 24, torch.float32, seed=1)
    with pytest.raises(ValueError, match="do not fit 3 key / 4 value heads"):
        gdn_decode_step(qkv, a, b, A_log, dt_bias, pool, num_k_heads=3, num_v_heads=4, state_indices=idx)
    with pytest.raises(ValueError, match="not a multiple"):
        gdn_decode_step(qkv[:, :-24], a[:, :3], b[:, :3], A_log[:3], dt_bias[:3], pool[:, :3], num_k_heads=2,
                        num_v_heads=3, state_indices=idx)  # fmt: skip


@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,H,V", [(3, 4, 24), (1, 2, 128), (5, 3, 40)])
def test_gated_norm_matches_native_and_float64(T, H, V, dtype, wdtype, triton_kernels):
    """The output's gated RMSNorm: z as a strided view of a wider projection row (as the layer's split), weights in
    the activations' dtype (their product rounded in it, as torch does) or fp32."""
    g = torch.Generator().manual_seed(T * 10 + V)
    o = (torch.randn(T, H, V, generator=g) * 3).to(dtype)
    z = (torch.randn(T, H * V + 5, generator=g) * 2).to(dtype)[:, 2 : 2 + H * V].view(T, H, V)
    w = (1 + 0.3 * torch.randn(V, generator=g)).to(dtype if wdtype == "same" else torch.float32)
    out = gated_rms_norm_silu(o, z, w, 1e-6)
    ref = gated_rms_norm_silu_native(o, z, w, 1e-6)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, ref, **tol)
    oracle = gated_rms_norm_silu_native(o.double(), z.double(), w.double(), 1e-6)
    torch.testing.assert_close(out.double(), oracle, **(tol if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,H,V", [(3, 4, 24), (5, 3, 40), (37, 2, 16)])
def test_gated_norm_gradients_match_float64(T, H, V, dtype, triton_kernels):
    """Training's path (``GatedNormSilu``: the forward kernel, a backward kernel): do, dz (into the strided view of
    the projection) and dweight against float64 autograd of the native composition; the forward as the decode's."""
    g = torch.Generator().manual_seed(T * 7 + V)
    o = (torch.randn(T, H, V, generator=g) * 3).to(dtype).requires_grad_()
    zw = (torch.randn(T, H * V + 5, generator=g) * 2).to(dtype).requires_grad_()
    w = (0.2 * torch.randn(V, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(T, H, V, generator=g).to(dtype)
    z = zw[:, 2 : 2 + H * V].view(T, H, V)
    out = gated_rms_norm_silu(o, z, w, 1e-6)
    do, dzw, dw = torch.autograd.grad(out, (o, zw, w), dy)
    ref64 = [t.detach().double().requires_grad_() for t in (o, zw, w)]
    z64 = ref64[1][:, 2 : 2 + H * V].view(T, H, V)
    out64 = gated_rms_norm_silu_native(ref64[0], z64, ref64[2], 1e-6)
    want = torch.autograd.grad(out64, ref64, dy.double())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), out64, **tol)
    for got, ref, name in zip((do, dzw, dw), want, ("do", "dz", "dweight")):
        scale = max(ref.abs().max().item(), 1.0) if name == "dweight" else 1.0  # sums over T x H rows
        torch.testing.assert_close(got.double() / scale, ref / scale, **tol, msg=name)
    assert (dzw[:, :2] == 0).all() and (dzw[:, 2 + H * V :] == 0).all()  # outside the view: no gradient


def _stepped(qkv, a, b, A_log, dt_bias, pool, idx, n, nk, nv):
    """The verify the reference way: the step kernel n times (each sequence's i-th token) on ``pool``."""
    B = idx.shape[0]
    per = [x.view(B, n, *x.shape[1:]) for x in (qkv, a, b)]
    outs = [gdn_decode_step(per[0][:, i], per[1][:, i], per[2][:, i], A_log, dt_bias, pool, num_k_heads=nk,
                            num_v_heads=nv, state_indices=idx) for i in range(n)]  # fmt: skip
    return torch.stack(outs, 1).flatten(0, 1)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32_pool", "bf16_pool"])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("B,nk,nv,dk,dv", CASES)
def test_verify_steps_equal_the_step_kernel_bit_for_bit(B, nk, nv, dk, dv, n, pool_dtype, triton_kernels):
    """The fused verify (the state in registers between a sequence's n tokens) against the step kernel stepped n
    times: the same outputs and final pool, to the bit; a padding row (slot -1) writes nothing."""
    qkv, a, b, A_log, dt_bias, pool, idx = _inputs(B * n, nk, nv, dk, dv, torch.float16, seed=B * 10 + n + dv,
                                                   slots=2 * B * n)  # fmt: skip
    idx = idx[:B].clone()
    idx[B // 2] = -1
    pool = pool.to(pool_dtype)
    ref_pool = pool.clone()
    ref_o = _stepped(qkv, a, b, A_log, dt_bias, ref_pool, idx, n, nk, nv)
    got_pool = pool.clone()
    o = gdn_verify_steps(qkv, a, b, A_log, dt_bias, got_pool, n=n, num_k_heads=nk, num_v_heads=nv, state_indices=idx)
    assert torch.equal(o, ref_o) and torch.equal(got_pool, ref_pool)
    assert bool((o.view(B, n, nv, dv)[B // 2] == 0).all())
    # the native path (the CPU's): the same steps
    nat_pool = pool.clone()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("ARENO_KERNELS", "native")
        nat = gdn_verify_steps(qkv, a, b, A_log, dt_bias, nat_pool, n=n, num_k_heads=nk, num_v_heads=nv,
                               state_indices=idx)  # fmt: skip
    tol = dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(nat, o, **tol)
    torch.testing.assert_close(nat_pool.float(), got_pool.float(), atol=1e-2 if pool_dtype != torch.float32 else 1e-5,
                               rtol=1e-2 if pool_dtype != torch.float32 else 1e-5)  # fmt: skip


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32_pool", "bf16_pool"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("B,nk,nv,dk,dv", CASES)
@pytest.mark.parametrize("path", ["triton", "native"])
def test_a_kept_verify_writes_no_state_and_its_replay_commits_the_accepted_tokens(B, nk, nv, dk, dv, n, pool_dtype,
                                                                                   path, triton_kernels, monkeypatch):
    """The engine's verify (``keep``): the outputs of stepping, the pool untouched; then ``keep.replay`` with each
    sequence's count of accepted tokens (0..n; a padding row and a count of 0 untouched) leaves the pool the step
    kernel leaves after that many steps, to the bit (the native path: its own steps, to the bit too)."""
    if path == "native":
        monkeypatch.setenv("ARENO_KERNELS", "native")
    qkv, a, b, A_log, dt_bias, pool, idx = _inputs(B * n, nk, nv, dk, dv, torch.float16, seed=B * 7 + n + dv,
                                                   slots=2 * B * n)  # fmt: skip
    idx = idx[:B].clone()
    idx[B // 2] = -1
    pool = pool.to(pool_dtype)
    counts = torch.tensor([(n - i) % (n + 1) for i in range(B)], dtype=torch.int32)  # n, n - 1, .., 0, n, ..
    kw = dict(num_k_heads=nk, num_v_heads=nv, state_indices=idx)
    ref_pool, ref_o = pool.clone(), _stepped(qkv, a, b, A_log, dt_bias, pool.clone(), idx, n, nk, nv)
    per = [x.view(B, n, *x.shape[1:]) for x in (qkv, a, b)]
    for i in range(n):  # the reference commit: step i for the sequences that accepted more than i tokens
        step_idx = torch.where(counts > i, idx, -1)
        gdn_decode_step(per[0][:, i], per[1][:, i], per[2][:, i], A_log, dt_bias, ref_pool, num_k_heads=nk,
                        num_v_heads=nv, state_indices=step_idx)  # fmt: skip
    keep, got_pool = VerifyInputs(B * n + 5), pool.clone()
    o = gdn_verify_steps(qkv, a, b, A_log, dt_bias, got_pool, n=n, keep=keep, **kw)
    assert torch.equal(o, ref_o) and torch.equal(got_pool, pool)
    qkv.fill_(9.0)  # the replay reads the kept copies, not the layer's tensors
    keep.replay(got_pool, idx, counts)
    assert torch.equal(got_pool, ref_pool)
    untouched = [int(s) for s, c in zip(idx.tolist(), counts.tolist()) if c == 0 and s >= 0]
    assert all(torch.equal(got_pool[s], pool[s]) for s in untouched)


def test_verify_steps_refuse_rows_that_are_not_sequences_times_tokens():
    qkv, a, b, A_log, dt_bias, pool, idx = _inputs(5, 1, 1, 8, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="gdn_verify_steps: 5 rows are not 2 sequences x 2 tokens"):
        gdn_verify_steps(qkv, a, b, A_log, dt_bias, pool, n=2, num_k_heads=1, num_v_heads=1, state_indices=idx[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bf16_at_the_9b_shape():
    """H200: Qwen3.5-9B's heads (16 key / 32 value heads of 128), 256 rows of a 300-slot pool, bf16 inputs: both
    kernels (the step, the output's gated norm) equal the unfused path."""
    qkv, a, b, A_log, dt_bias, pool, idx = (t.cuda() for t in _inputs(256, 16, 32, 128, 128, torch.bfloat16, seed=3,
                                                                        slots=300))  # fmt: skip
    kw = dict(num_k_heads=16, num_v_heads=32, state_indices=idx)
    state, ref_state = pool.clone(), pool.clone()
    o = gdn_decode_step(qkv, a, b, A_log, dt_bias, state, **kw)
    ref = gdn_decode_step_native(qkv, a, b, A_log, dt_bias, ref_state, **kw)
    torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # q and k are rounded to bf16 after their fp32 norms: a last-bit difference in a norm flips a rounding now and
    # then (~1e-5 of the state's elements here), moving those elements by up to a bf16 ulp of k v; the rest agree
    torch.testing.assert_close(state, ref_state, atol=5e-3, rtol=1e-3)
    assert ((state - ref_state).abs() > 1e-4 + 1e-4 * ref_state.abs()).float().mean() < 1e-4
    o = (torch.randn(256, 32, 128, device="cuda") * 3).bfloat16()
    z = torch.randn(256, 32 * 128 + 64, device="cuda").bfloat16()[:, : 32 * 128].view(256, 32, 128)
    w = (1 + 0.3 * torch.randn(128, device="cuda")).bfloat16()
    out, ref = gated_rms_norm_silu(o, z, w, 1e-6), gated_rms_norm_silu_native(o, z, w, 1e-6)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert (out != ref).float().mean() < 0.01  # the native path's roundings (weight x norm in bf16) kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_gated_norm_training_bf16():
    """H200, the 9B train shape's gated norm (1,024 tokens x 32 heads of 128, bf16): gradients against float64."""
    T, H, V = 1024, 32, 128
    o = (torch.randn(T, H, V, device="cuda") * 3).bfloat16().requires_grad_()
    zw = torch.randn(T, H * V + 64, device="cuda").bfloat16().requires_grad_()
    w = (0.2 * torch.randn(V, device="cuda")).bfloat16().requires_grad_()
    dy = torch.randn(T, H, V, device="cuda").bfloat16()
    grads = torch.autograd.grad(gated_rms_norm_silu(o, zw[:, : H * V].view(T, H, V), w, 1e-6), (o, zw, w), dy)
    ref = [t.detach().double().requires_grad_() for t in (o, zw, w)]
    want = torch.autograd.grad(gated_rms_norm_silu_native(ref[0], ref[1][:, : H * V].view(T, H, V), ref[2], 1e-6),
                               ref, dy.double())  # fmt: skip
    for got, exp in zip(grads, want):
        scale = max(exp.abs().max().item(), 1.0)
        torch.testing.assert_close(got.double() / scale, exp / scale, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32_pool", "bf16_pool"])
def test_gpu_verify_steps_at_the_9b_shape(pool_dtype):
    """The compiled verify kernel at Qwen3.5-9B's linear-attention shape (64 sequences x 3 tokens, 16 key / 32 value
    heads of 128, bf16 activations) against the step kernel stepped three times: the same bits (outputs, the pool);
    then the engine's verify (inputs kept, no state written) and the replay of each row's accepted count, the same
    bits as that many steps; times printed (bench/gdn_decode.py's shape)."""
    B, n, nk, nv, d = 64, 3, 16, 32, 128
    qkv, a, b, A_log, dt_bias, pool, idx = _inputs(B * n, nk, nv, d, d, torch.bfloat16, seed=3, slots=2 * B)
    qkv, a, b, A_log, dt_bias = (x.cuda() for x in (qkv, a, b, A_log, dt_bias))
    pool, idx = pool.to("cuda", pool_dtype), idx[:B].clone().cuda()
    kw = dict(num_k_heads=nk, num_v_heads=nv, state_indices=idx)
    ref_pool = pool.clone()
    per = [x.view(B, n, *x.shape[1:]) for x in (qkv, a, b)]
    ref_o = torch.stack([gdn_decode_step(per[0][:, i], per[1][:, i], per[2][:, i], A_log, dt_bias, ref_pool, **kw)
                         for i in range(n)], 1).flatten(0, 1)  # fmt: skip
    got_pool = pool.clone()
    o = gdn_verify_steps(qkv, a, b, A_log, dt_bias, got_pool, n=n, **kw)
    assert torch.equal(o, ref_o) and torch.equal(got_pool, ref_pool)
    counts = torch.randint(1, n + 1, (B,), dtype=torch.int32, device="cuda")
    want = pool.clone()
    for i in range(n):
        gdn_decode_step(per[0][:, i], per[1][:, i], per[2][:, i], A_log, dt_bias, want, num_k_heads=nk,
                        num_v_heads=nv, state_indices=torch.where(counts > i, idx, -1))  # fmt: skip
    keep, got_pool = VerifyInputs(B * n), pool.clone()
    o = gdn_verify_steps(qkv, a, b, A_log, dt_bias, got_pool, n=n, keep=keep, **kw)
    assert torch.equal(o, ref_o) and torch.equal(got_pool, pool)
    keep.replay(got_pool, idx, counts)
    assert torch.equal(got_pool, want)
    times = {
        "fused": cuda_ms(lambda: gdn_verify_steps(qkv, a, b, A_log, dt_bias, got_pool, n=n, **kw)),
        "kept": cuda_ms(lambda: gdn_verify_steps(qkv, a, b, A_log, dt_bias, got_pool, n=n, keep=keep, **kw)),
        "replay": cuda_ms(lambda: keep.replay(got_pool, idx, counts)),
        "stepped": cuda_ms(lambda: [gdn_decode_step(per[0][:, i], per[1][:, i], per[2][:, i], A_log, dt_bias,
                                                    ref_pool, **kw) for i in range(n)]),  # fmt: skip
    }
    print(f"verify of {B} x {n} tokens, one layer, {pool_dtype}: " + ", ".join(f"{k} {v:.3f} ms"
                                                                              for k, v in times.items()))
    assert times["fused"] < times["stepped"] and times["kept"] + times["replay"] < times["stepped"]
