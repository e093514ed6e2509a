"""paged_attention() and store_kvcache(): Triton (interpreted on CPU) and native paths against a float64 oracle."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from areno.kernels.attention.paged import (
    paged_attention,
    paged_attention_native,
    paged_attention_reference,
    store_kvcache,
)

# Relative to the largest reference magnitude: fp16 rounds P before the PV matmul and the output once.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


@pytest.fixture
def nan_buffers(monkeypatch):
    """torch.empty / empty_like hand back NaN-filled memory, so any element a kernel forgets to write shows."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7777)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))
    assert torch.isnan(torch.empty(3)).all()


def make_cache(seq_lens, hkv, d, page, dtype, g, device="cpu", spare_blocks=3):
    """Random caches whose blocks are scattered at random; table entries past a sequence's blocks are -1."""
    need = [-(-n // page) for n in seq_lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + spare_blocks
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return k_cache, v_cache, table.to(device), lens.to(device)


def check(q, k_cache, v_cache, table, lens, tol, what, cu_q=None, max_q=None, num_splits=None):
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lens, cu_seqlens_q=cu_q)
    got = paged_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                          num_splits=num_splits)
    native = paged_attention_native(q, k_cache, v_cache, table, lens, q.shape[-1] ** -0.5, cu_q,
                                     max_q or q.shape[0])
    bound = tol * max(want.abs().max().item(), 1.0)
    for name, out in (("triton", got), ("native", native)):
        assert out.shape == q.shape and out.dtype == q.dtype, name
        assert torch.isfinite(out).all(), f"{what} {name}: non-finite output (unwritten element?)"
        err = (out.double() - want).abs().max().item()
        assert err <= bound, f"{what} {name}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode(group, page, dtype, triton_kernels, nan_buffers):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    seq_lens = [1, 7, 127, 129, 300][: 5 if group <= 2 else 3]
    hkv = 8 // group if group > 1 else 2
    k_cache, v_cache, table, lens = make_cache(seq_lens, hkv, 64, page, dtype, g)
    q = torch.randn(len(seq_lens), hkv * group, 64, generator=g).to(dtype)
    for splits in (1, 3):
        check(q, k_cache, v_cache, table, lens, TOL[dtype], f"group={group} page={page} splits={splits} seed={seed}",
              num_splits=splits)


@pytest.mark.parametrize("d", [80, 128])
def test_decode_head_dims_and_many_splits(d, triton_kernels, nan_buffers):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table, lens = make_cache([2, 129, 40], 2, d, 16, torch.float32, g)
    q = torch.randn(3, 4, d, generator=g)
    for splits in (4, 16):  # more splits than a short sequence has key blocks: empty splits must merge as nothing
        check(q, k_cache, v_cache, table, lens, TOL[torch.float32], f"d={d} splits={splits} seed={seed}",
              num_splits=splits)


def test_a_verify_splits_its_rows_as_a_decode_of_its_sequences_does(triton_kernels, monkeypatch):
    """``split_rows``: the split-K factor is chosen for that many sequences (a speculative verify's K + 1 decode rows
    a sequence), so each row reduces its keys in the order a plain decode step splits them; the model passes
    ``AttentionMetadata.split_rows``, the verify's sequence count."""
    from areno.kernels.attention import paged
    from areno.models import AttentionMetadata

    seen = []
    monkeypatch.setattr(paged, "num_splits_for", lambda q, programs, keys: seen.append(programs) or 1)
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache, table, lens = make_cache([40, 41, 42, 9, 10, 11], 2, 64, 16, torch.float32, g)
    q = torch.randn(6, 4, 64, generator=g)
    paged_attention(q, k_cache, v_cache, table, lens)
    paged_attention(q, k_cache, v_cache, table, lens, split_rows=2)
    assert seen == [6 * 2, 2 * 2]  # programs: rows (or sequences) x KV heads
    meta = AttentionMetadata(slot_mapping=None, is_prefill=False, block_table=table, seq_lens=lens, tokens_per_seq=3)
    assert meta.split_rows == 2
    assert AttentionMetadata(slot_mapping=None, is_prefill=False, block_table=table).split_rows is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("page,group", [(16, 2), (64, 4), (16, 8)])
def test_multi_token_queries_over_cached_prefix(page, group, dtype, triton_kernels, nan_buffers):
    """Chunked prefill / verify: each sequence's last tokens attend causally to its whole cached context."""
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    seq_lens = [1, 20, 150, 9, 70]
    q_lens = [1, 5, 33, 0, 70]  # 0: nothing new for that sequence; 70 == seq_len: a whole prompt
    hkv = 2
    k_cache, v_cache, table, lens = make_cache(seq_lens, hkv, 64, page, dtype, g)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hkv * group, 64, generator=g).to(dtype)
    for splits in (1, 2):
        check(q, k_cache, v_cache, table, lens, TOL[dtype], f"page={page} group={group} splits={splits} seed={seed}",
              cu_q=cu_q, max_q=max(q_lens), num_splits=splits)


def test_native_default_dispatch_matches_reference(native_kernels):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    k_cache, v_cache, table, lens = make_cache([5, 33], 2, 64, 16, torch.float32, g)
    q = torch.randn(2, 4, 64, generator=g)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lens)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, table, lens).double(), want, atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_attention(q[:1], k_cache, v_cache, table, lens)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("mode", ["triton", "native"])
def test_store_kvcache(mode, page, monkeypatch):
    monkeypatch.setenv("ARENO_KERNELS", mode)
    hkv, d, num_blocks, T = 3, 80, 5, 40
    k_cache = torch.randn(num_blocks, page, hkv, d, dtype=torch.float16)
    v_cache = torch.randn(num_blocks, page, hkv, d, dtype=torch.float16)
    k = torch.randn(T, hkv, d, dtype=torch.float16)
    v = torch.randn(T, hkv, d, dtype=torch.float16)
    slots = torch.randperm(num_blocks * page)[:T]
    slots[torch.randperm(T)[:7]] = -1  # padding tokens write nothing
    want_k, want_v = k_cache.clone().view(-1, hkv, d), v_cache.clone().view(-1, hkv, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s], want_v[s] = k[t], v[t]
    store_kvcache(k, v, k_cache, v_cache, slots.to(torch.int32))
    assert torch.equal(k_cache.view(-1, hkv, d), want_k)
    assert torch.equal(v_cache.view(-1, hkv, d), want_v)


def test_store_then_decode_round_trip(triton_kernels):
    """Prefill writes a prompt through store_kvcache, decode appends one token, paged attention sees both."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    hkv, hq, d, page, n = 2, 4, 64, 16, 37
    k_cache = torch.zeros(8, page, hkv, d)
    v_cache = torch.zeros(8, page, hkv, d)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    k, v = torch.randn(n + 1, hkv, d, generator=g), torch.randn(n + 1, hkv, d, generator=g)
    slots = torch.tensor([table[0, j // page].item() * page + j % page for j in range(n + 1)], dtype=torch.int32)
    store_kvcache(k[:n], v[:n], k_cache, v_cache, slots[:n])
    store_kvcache(k[n:], v[n:], k_cache, v_cache, slots[n:])
    q = torch.randn(1, hq, d, generator=g)
    got = paged_attention(q, k_cache, v_cache, table, torch.tensor([n + 1], dtype=torch.int32))
    s = torch.einsum("hd,jhd->hj", q[0].double(), k.double().repeat_interleave(2, 1)) * d**-0.5
    want = torch.einsum("hj,jhd->hd", s.softmax(-1), v.double().repeat_interleave(2, 1))
    torch.testing.assert_close(got[0].double(), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# GPU (bf16, real sizes): error no worse than twice the native path's, and CUDA-graph capture.


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("batch,ctx", [(64, 2048), (2, 4000)])
def test_gpu_bf16_decode(batch, ctx, page):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    seq_lens = torch.randint(1, ctx + 1, (batch,), generator=g).tolist()
    seq_lens[0] = ctx
    k_cache, v_cache, table, lens = make_cache(seq_lens, 8, 128, page, torch.bfloat16, g, device="cuda")
    q = torch.randn(batch, 16, 128, generator=g).to("cuda", torch.bfloat16)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lens)
    got = paged_attention(q, k_cache, v_cache, table, lens)
    native = paged_attention_native(q, k_cache, v_cache, table, lens, 128**-0.5, None, 1)
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * (native.double() - want).abs().max().item() + 2e-3, err


@pytest.mark.gpu
def test_gpu_bf16_chunked_prefill():
    g = torch.Generator().manual_seed(random.randrange(2**31))
    seq_lens, q_lens = [1, 900, 2048, 300], [1, 256, 512, 300]
    k_cache, v_cache, table, lens = make_cache(seq_lens, 8, 128, 16, torch.bfloat16, g, device="cuda")
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), 16, 128, generator=g).to("cuda", torch.bfloat16)
    want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lens, cu_seqlens_q=cu_q)
    got = paged_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu_q, max_seqlen_q=max(q_lens))
    native = paged_attention_native(q, k_cache, v_cache, table, lens, 128**-0.5, cu_q, max(q_lens))
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * (native.double() - want).abs().max().item() + 2e-3, err


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    """store + decode captured once; replays with new seq_lens / q / slots give fresh, correct results."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    B, hkv, hq, d, page = 4, 8, 16, 128, 16
    capacity = [120, 20, 2020, 1030]  # tokens each sequence's blocks can hold
    k_cache, v_cache, table, lens = make_cache(capacity, hkv, d, page, torch.bfloat16, g, device="cuda")
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(B, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    slots = torch.zeros(B, dtype=torch.int32, device="cuda")

    def step():
        store_kvcache(k_new, v_new, k_cache, v_cache, slots)
        return paged_attention(q, k_cache, v_cache, table, lens)

    def set_inputs(new_lens):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        pos = lens.long() - 1
        slots.copy_((table.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page).int())
        q.normal_()
        k_new.normal_()
        v_new.normal_()

    set_inputs([100, 1, 2000, 513])
    step()  # warm up (compile) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new_lens in ([101, 2, 2001, 514], [5, 16, 17, 1000]):
        set_inputs(new_lens)
        graph.replay()
        want = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), table, lens)
        assert (out.double() - want).abs().max().item() <= 2e-2
