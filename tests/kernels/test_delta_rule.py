"""Gated delta rule: Triton (interpreted on CPU) and the native chunked path vs a float64 token-by-token recurrence,
forward and every gradient; the decode step vs the chunked forward, token by token, and on a bf16 state pool."""


import pytest
import torch
import torch.nn.functional as F

from areno.kernels.linear_attn import delta_rule as mod
from areno.kernels.linear_attn.delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_native,
    delta_rule_reference,
    fused_recurrent_gated_delta_rule_step,
    fused_recurrent_gated_delta_rule_verify,
)
from areno.kernels.linear_attn.steps import VerifyInputs

NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


@pytest.fixture
def small_tiles(monkeypatch):
    """The interpreter runs every Triton op in Python: 8-row chunks of two 4-row sub-blocks and 4-wide tiles keep
    the tests fast while exercising the same code paths (cross-sub-block matmuls, in-block element loop)."""
    monkeypatch.setattr(mod, "SUB", 4)
    monkeypatch.setattr(mod, "MIN_BLOCK", 4)
    monkeypatch.setattr(mod, "CHUNKS", (8, 16, 32, 64))


def _inputs(lens, H, K, V, gate, dtype=torch.float32, device="cpu", seed=0):
    """Random packed inputs like KDA's: unit-norm k, g in [-lower, 0] per channel ("channel") or per head ("head")."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)
    q = r(T, H, K)
    k = F.normalize(r(T, H, K), dim=-1)
    v = r(T, H, V)
    g = -5 * torch.rand(T, H, *((K,) if gate == "channel" else ()), generator=gen) ** 2
    beta = torch.rand(T, H, generator=gen)
    s0 = r(len(lens), H, K, V)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ts = [t.to(device=device, dtype=dtype) for t in (q, k, v, g, beta)] + [s0.to(device)]
    return ts, cu


def _run(fn, ts, cu, do, dst, **kw):
    ts = [t.detach().clone().requires_grad_() for t in ts]
    o, st = fn(*ts[:5], initial_state=ts[5], cu_seqlens=cu, output_final_state=True, **kw)
    grads = torch.autograd.grad((o, st), ts, (do.to(o.dtype), dst.to(st.dtype)))
    return o, st, grads


def _check(fn, lens, H, K, V, gate, chunk_size, tol=(2e-4, 2e-4)):
    ts, cu = _inputs(lens, H, K, V, gate)
    do, dst = torch.randn(sum(lens), H, V), torch.randn(len(lens), H, K, V)
    ref = _run(delta_rule_reference, [t.double() for t in ts], cu, do.double(), dst.double())
    out = _run(fn, ts, cu, do, dst, chunk_size=chunk_size)
    rtol, atol = tol
    torch.testing.assert_close(out[0].double(), ref[0], rtol=rtol, atol=atol, msg="o")
    torch.testing.assert_close(out[1].double(), ref[1], rtol=rtol, atol=atol, msg="final_state")
    for name, g, g_ref in zip(NAMES, out[2], ref[2]):
        scale = max(g_ref.abs().max().item(), 1.0)
        torch.testing.assert_close(g.double(), g_ref, rtol=rtol, atol=atol * scale, msg=f"d{name}")


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_native_chunked_matches_recurrence(gate):
    _check(chunk_gated_delta_rule_native, [5, 37, 20], 1, 16, 8, gate, chunk_size=16)
    _check(chunk_gated_delta_rule_native, [45], 1, 8, 4, gate, chunk_size=32)


@pytest.mark.parametrize("gate,lens,H", [("channel", [3, 13, 6], 1), ("head", [11, 6], 2)])
def test_triton_matches_recurrence(triton_kernels, small_tiles, monkeypatch, gate, lens, H):
    """Lengths not multiples of the chunk (8), several packed sequences, initial states, every gradient."""
    ran = []
    real = mod.ChunkGatedDeltaRule.apply
    monkeypatch.setattr(mod.ChunkGatedDeltaRule, "apply", lambda *a: ran.append(1) or real(*a))
    _check(chunk_gated_delta_rule, lens, H, 8, 4, gate, chunk_size=8)
    assert ran, "the Triton path did not run"


def test_public_function_without_state(native_kernels):
    ts, cu = _inputs([9, 23], 2, 8, 8, "channel")
    o, st = chunk_gated_delta_rule(*ts[:5], cu_seqlens=cu, chunk_size=16)
    o_ref, _ = delta_rule_reference(*[t.double() for t in ts[:5]], cu_seqlens=cu)
    assert st is None and o.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    o1, _ = chunk_gated_delta_rule(*[t[:9] for t in ts[:5]], chunk_size=16)  # cu_seqlens None: one sequence
    torch.testing.assert_close(o1, o[:9], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["native", "triton"])
@pytest.mark.parametrize("gate", ["channel", "head"])
def test_decode_step_follows_chunked_forward(monkeypatch, kernels, gate):
    """Prefill a few tokens with the chunked path, then step token by token in a state pool: every output and the
    final states equal the chunked forward over the whole sequences."""
    lens, H, K, V = [7, 4, 9], 2, 8, 8
    (q, k, v, g, beta, s0), cu = _inputs(lens, H, K, V, gate)
    monkeypatch.setenv("ARENO_KERNELS", "native")  # the chunked reference
    o_full, st_full = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu,
                                             output_final_state=True, chunk_size=16)
    monkeypatch.setenv("ARENO_KERNELS", kernels)
    pool = torch.randn(6, H, K, V)
    slots = torch.tensor([4, -1, 1, 2])  # row 1 is a padding row: its slot (and output) must be left alone
    seqs = [0, None, 1, 2]
    pool[4], pool[1], pool[2] = s0[0], s0[1], s0[2]
    untouched = pool[[0, 3, 5]].clone()
    starts = cu[:-1].tolist()
    for step in range(max(lens)):
        rows = [starts[n] + min(step, lens[n] - 1) if n is not None else 0 for n in seqs]
        idx = torch.tensor(slots.tolist())
        for i, n in enumerate(seqs):  # sequences that are done skip the step
            if n is not None and step >= lens[n]:
                idx[i] = -1
        o = fused_recurrent_gated_delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], pool,
                                                  state_indices=idx)
        for i in range(len(seqs)):
            if idx[i] < 0:
                assert (o[i] == 0).all()
            else:
                torch.testing.assert_close(o[i], o_full[rows[i]], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[[4, 1, 2]], st_full, rtol=1e-4, atol=1e-4)
    assert torch.equal(pool[[0, 3, 5]], untouched)
    # without a pool: the state is [B, H, K, V] and updated in place
    st = s0[:1].clone()
    for t in range(lens[0]):
        o = fused_recurrent_gated_delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], st)
        torch.testing.assert_close(o[0], o_full[t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(st[0], st_full[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", ["native", "triton"])
@pytest.mark.parametrize("gate", ["channel", "head"])
def test_decode_step_on_a_bf16_pool(monkeypatch, kernels, gate):
    """A bf16 state pool (--mamba-ssm-cache-dtype bfloat16): read in bf16, stepped in fp32, stored rounded to bf16:
    the fp32 step's output from the same state and its new state within one bf16 ulp (Triton's interpreter truncates
    fp32 to bf16 where the GPU rounds to nearest); a padding row and the slots no row names are left alone."""
    H, K, V = 2, 8, 8
    (q, k, v, g, beta, _), _ = _inputs([3], H, K, V, gate)  # 3 rows of one step
    monkeypatch.setenv("ARENO_KERNELS", kernels)
    pool = torch.randn(5, H, K, V).bfloat16()
    ref = pool.float()
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)
    o = fused_recurrent_gated_delta_rule_step(q, k, v, g, beta, pool, state_indices=idx)
    monkeypatch.setenv("ARENO_KERNELS", "native")
    o_ref = fused_recurrent_gated_delta_rule_step(q, k, v, g, beta, ref, state_indices=idx)
    assert pool.dtype == torch.bfloat16 and (o[1] == 0).all()
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.float(), ref.bfloat16().float(), rtol=2**-7, atol=1e-6)
    assert torch.equal(pool[[1, 2, 4]].float(), ref[[1, 2, 4]])
    with pytest.raises(ValueError, match="state must be fp32, bf16 or fp64"):
        fused_recurrent_gated_delta_rule_step(q, k, v, g, beta, pool.half(), state_indices=idx)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32_pool", "bf16_pool"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("gate", ["channel", "head"])
def test_verify_equals_the_step_kernel_stepped_bit_for_bit(monkeypatch, gate, n, pool_dtype):
    """A speculative verify's n tokens a sequence in one kernel (the state in registers between them) against the
    step kernel stepped n times: the same outputs and pool to the bit; a padding row (slot -1) writes nothing; the
    native path alike within rounding."""
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    B, H, K, V = 3, 2, 8, 12
    (q, k, v, g, beta, _), _ = _inputs([B * n], H, K, V, gate, seed=n)
    pool = (torch.randn(7, H, K, V) * 0.5).to(pool_dtype)
    idx = torch.tensor([5, -1, 2], dtype=torch.int32)
    ref_pool, outs = pool.clone(), []
    per = [x.view(B, n, *x.shape[1:]) for x in (q, k, v, g, beta)]
    for i in range(n):
        outs.append(fused_recurrent_gated_delta_rule_step(*(x[:, i] for x in per), ref_pool, state_indices=idx))
    got_pool = pool.clone()
    o = fused_recurrent_gated_delta_rule_verify(q, k, v, g, beta, got_pool, n=n, state_indices=idx)
    assert torch.equal(o, torch.stack(outs, 1).flatten(0, 1)) and torch.equal(got_pool, ref_pool)
    assert bool((o.view(B, n, H, V)[1] == 0).all())
    monkeypatch.setenv("ARENO_KERNELS", "native")
    nat_pool = pool.clone()
    nat = fused_recurrent_gated_delta_rule_verify(q, k, v, g, beta, nat_pool, n=n, state_indices=idx)
    tol = 1e-4 if pool_dtype == torch.float32 else 2e-2  # the interpreter truncates to bf16, torch rounds
    torch.testing.assert_close(nat, o, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match=f"are not 2 sequences x {n} tokens"):
        fused_recurrent_gated_delta_rule_verify(q, k, v, g, beta, nat_pool, n=n, state_indices=idx[:2])


@pytest.mark.parametrize("path", ["triton", "native"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32_pool", "bf16_pool"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("gate", ["channel", "head"])
def test_a_kept_verify_writes_no_state_and_its_replay_commits_the_accepted_tokens(monkeypatch, gate, n, pool_dtype,
                                                                                   path):
    """The engine's verify (``keep``): the outputs of stepping with the pool untouched; ``keep.replay`` with each
    sequence's accepted count (0..n; a padding row and a count of 0 untouched) leaves the pool as that many steps of
    the step kernel do, to the bit."""
    monkeypatch.setenv("ARENO_KERNELS", path)
    B, H, K, V = 5, 2, 8, 12
    (q, k, v, g, beta, _), _ = _inputs([B * n], H, K, V, gate, seed=n + 10)
    pool = (torch.randn(9, H, K, V) * 0.5).to(pool_dtype)
    idx = torch.tensor([5, -1, 2, 0, 7], dtype=torch.int32)
    counts = torch.tensor([n, n, 0, 1, n - 1], dtype=torch.int32)
    per = [x.view(B, n, *x.shape[1:]) for x in (q, k, v, g, beta)]
    ref_pool, aside, outs = pool.clone(), pool.clone(), []
    for i in range(n):  # the outputs: n plain steps
        outs.append(fused_recurrent_gated_delta_rule_step(*(x[:, i] for x in per), aside, state_indices=idx))
        fused_recurrent_gated_delta_rule_step(*(x[:, i] for x in per), ref_pool,
                                              state_indices=torch.where(counts > i, idx, -1))  # the commit
    keep, got_pool = VerifyInputs(B * n), pool.clone()
    o = fused_recurrent_gated_delta_rule_verify(q, k, v, g, beta, got_pool, n=n, keep=keep, state_indices=idx)
    assert torch.equal(o, torch.stack(outs, 1).flatten(0, 1)) and torch.equal(got_pool, pool)
    k.fill_(3.0)  # the replay reads the kept copies
    keep.replay(got_pool, idx, counts)
    assert torch.equal(got_pool, ref_pool) and torch.equal(got_pool[2], pool[2])


def test_rejects_bad_shapes():
    ts, cu = _inputs([4], 2, 8, 8, "channel")
    with pytest.raises(ValueError, match="g must be"):
        chunk_gated_delta_rule(*ts[:3], ts[3][..., :3], ts[4])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(*ts[:5], initial_state=ts[5][:, :1])


# ---- GPU: bf16 at real sizes ---------------------------------------------------------------------------------------


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["channel", "head"])
def test_triton_gpu_bf16_matches_float64(gate, monkeypatch):
    """KDA-sized heads (K = V = 128), chunk 64, packed sequences of odd lengths with initial states: the Triton
    path in bf16 against the native chunked path in float64 (itself checked against the recurrence on CPU)."""
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    lens, H, K, V = [1000, 64, 3001, 77], 4, 128, 128
    ts, cu = _inputs(lens, H, K, V, gate, dtype=torch.bfloat16, device="cuda")
    ts[3] = ts[3].float()  # g as the model computes it (fp32 gate)
    do = torch.randn(sum(lens), H, V, device="cuda")
    dst = torch.randn(len(lens), H, K, V, device="cuda")
    out = _run(chunk_gated_delta_rule, ts, cu, do, dst, chunk_size=64)
    ref = _run(chunk_gated_delta_rule_native, [t.double() for t in ts], cu, do.double(), dst.double(), chunk_size=64)
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32
    assert _rel(out[0], ref[0]) < 2e-2, "o"
    assert _rel(out[1], ref[1]) < 2e-2, "final_state"
    for name, g, g_ref in zip(NAMES, out[2], ref[2]):
        assert torch.isfinite(g).all(), name
        assert _rel(g, g_ref) < 3e-2, f"d{name}: relative error {_rel(g, g_ref):.3g}"


@pytest.mark.gpu
def test_decode_step_cuda_graph_replay():
    """The step (pool slots, a skipped row) captured in a CUDA graph and replayed on new inputs equals the native
    step on copies."""
    B, H, K, V = 8, 4, 128, 128
    q, k, v = (torch.randn(B, H, d, device="cuda", dtype=torch.bfloat16) for d in (K, K, V))
    g = -torch.rand(B, H, K, device="cuda")
    beta = torch.rand(B, H, device="cuda")
    pool = torch.randn(12, H, K, V, device="cuda")
    idx = torch.tensor([3, 0, -1, 7, 11, 1, 2, 5], device="cuda", dtype=torch.int32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_recurrent_gated_delta_rule_step(q, k, v, g, beta, pool.clone(), state_indices=idx)  # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = fused_recurrent_gated_delta_rule_step(q, k, v, g, beta, pool, state_indices=idx)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    before = pool.clone()
    graph.replay()
    torch.cuda.synchronize()
    ref_pool = before.clone()
    o_ref = mod.gated_delta_rule_step_native(q, k, v, g, beta, ref_pool, state_indices=idx)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gate", ["channel", "head"])
def test_verify_equals_stepping_on_the_gpu(monkeypatch, gate):
    """The compiled verify kernel at KDA's head size (64 sequences x 3 tokens, 16 heads of 128, bf16 inputs, fp32
    pool) against the compiled step kernel stepped three times: the same bits; the engine's verify (inputs kept, no
    state written) and the replay of each row's accepted count: the bits of that many steps."""
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    B, n, H, D = 64, 3, 16, 128
    (q, k, v, g, beta, _), _ = _inputs([B * n], H, D, D, gate, dtype=torch.bfloat16, device="cuda")
    g = g.float()
    pool = torch.randn(2 * B, H, D, D, device="cuda") * 0.1
    idx = torch.randperm(2 * B, device="cuda")[:B].int()
    idx[5] = -1
    ref_pool, outs = pool.clone(), []
    per = [x.view(B, n, *x.shape[1:]) for x in (q, k, v, g, beta)]
    for i in range(n):
        outs.append(fused_recurrent_gated_delta_rule_step(*(x[:, i] for x in per), ref_pool, state_indices=idx))
    got_pool = pool.clone()
    o = fused_recurrent_gated_delta_rule_verify(q, k, v, g, beta, got_pool, n=n, state_indices=idx)
    assert torch.equal(o, torch.stack(outs, 1).flatten(0, 1)) and torch.equal(got_pool, ref_pool)
    counts, want = torch.randint(1, n + 1, (B,), dtype=torch.int32, device="cuda"), pool.clone()
    for i in range(n):
        fused_recurrent_gated_delta_rule_step(*(x[:, i] for x in per), want,
                                              state_indices=torch.where(counts > i, idx, -1))  # fmt: skip
    keep, got_pool = VerifyInputs(B * n), pool.clone()
    o = fused_recurrent_gated_delta_rule_verify(q, k, v, g, beta, got_pool, n=n, keep=keep, state_indices=idx)
    assert torch.equal(o, torch.stack(outs, 1).flatten(0, 1)) and torch.equal(got_pool, pool)
    keep.replay(got_pool, idx, counts)
    assert torch.equal(got_pool, want)
