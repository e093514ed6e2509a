"""The FP8 paged KV cache at the kernel level (kernels/attention/paged.py with k_scale/v_scale): the quantising cache
write (Triton, interpreted, byte for byte the native one; the round trip within E4M3's bound of the float64 values)
and paged attention reading FP8 K/V (Triton and native against the float64 oracle on the dequantised cache, and
near the unquantised cache's answer), with scales that are a head-prefix view of wider rows (Gemma 4's layers) too.
The engine's --kv-cache-dtype fp8: tests/engine/test_kv_cache_fp8.py."""

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
from areno.kernels.fp8 import FP8

HKV, D, PAGE = 2, 64, 16


def fp8_cache(num_blocks: int):
    caches = [torch.zeros(num_blocks, PAGE, HKV, D, dtype=FP8) for _ in range(2)]
    scales = [torch.zeros(num_blocks, PAGE, HKV) for _ in range(2)]
    return caches, scales


def dequantized(cache, scale):
    return cache.double() * scale.double()[..., None]


def filled(seq_lens, g, mode, monkeypatch):
    """FP8 caches holding random K/V for ``seq_lens`` (written through store_kvcache in ``mode``), the float64
    originals as plain caches, the block table and lengths."""
    monkeypatch.setenv("ARENO_KERNELS", mode)
    need = [-(-n // PAGE) for n in seq_lens]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    table = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    (kc, vc), (ks, vs) = fp8_cache(sum(need) + 2)
    k_orig = torch.zeros(kc.shape, dtype=torch.float64)
    v_orig = torch.zeros(kc.shape, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        j = torch.arange(n)
        slots = table[b].long()[j // PAGE] * PAGE + j % PAGE
        k = torch.randn(n, HKV, D, generator=g) * torch.rand(n, HKV, 1, generator=g) * 4
        v = torch.randn(n, HKV, D, generator=g)
        store_kvcache(k, v, kc, vc, slots.to(torch.int32), ks, vs)
        k_orig.view(-1, HKV, D)[slots] = k.double()
        v_orig.view(-1, HKV, D)[slots] = v.double()
    return (kc, vc, ks, vs), (k_orig, v_orig), table, torch.tensor(seq_lens, dtype=torch.int32)


def test_the_cache_write_quantises_each_head_row_and_triton_matches_native(monkeypatch):
    seed = random.randrange(2**31)
    lens = [5, 40, 17]
    out = {m: filled(lens, torch.Generator().manual_seed(seed), m, monkeypatch) for m in ("native", "triton")}
    (kc, vc, ks, vs), (k64, v64), _, _ = out["native"]
    tk, tv, tks, tvs = out["triton"][0]
    assert torch.equal(kc.view(torch.uint8), tk.view(torch.uint8)) and torch.equal(vc.view(torch.uint8),
                                                                                   tv.view(torch.uint8))
    assert torch.equal(ks, tks) and torch.equal(vs, tvs), f"seed {seed}"
    for cache, scale, orig in ((kc, ks, k64), (vc, vs, v64)):
        written = orig.abs().amax(-1) > 0
        s64 = orig.abs().amax(-1).clamp(min=1e-10) / 448  # the definition, in float64
        assert int(written.sum()) == sum(lens) * HKV
        assert torch.allclose(scale.double()[written], s64[written], rtol=1e-6, atol=0)
        err = (dequantized(cache, scale) - orig).abs()[written]
        assert (err <= 2**-4 * orig.abs()[written] + 2**-10 * s64[written][..., None] * 1.0001).all(), f"seed {seed}"


def test_slot_minus_one_writes_nothing(monkeypatch, triton_kernels):
    (kc, vc), (ks, vs) = fp8_cache(2)
    k = torch.randn(3, HKV, D)
    store_kvcache(k, k, kc, vc, torch.tensor([-1, 5, -1], dtype=torch.int32), ks, vs)
    written = (kc.view(torch.uint8) != 0).flatten(2).any(-1)
    assert written.nonzero().tolist() == [[0, 5]] and (ks != 0).nonzero()[:, :2].unique(dim=0).tolist() == [[0, 5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group,splits", [(1, 1), (4, 3)])
def test_paged_attention_reads_the_fp8_cache(dtype, group, splits, monkeypatch):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = [1, 40, 70], [1, 5, 33]
    (kc, vc, ks, vs), (k64, v64), table, lens = filled(seq_lens, g, "native", monkeypatch)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), HKV * group, D, generator=g).to(dtype)
    # the oracle on the dequantised cache, rounded to q's dtype as both paths dequantise
    kd, vd = dequantized(kc, ks).to(dtype).double(), dequantized(vc, vs).to(dtype).double()
    want = paged_attention_reference(q.double(), kd, vd, table, lens, cu_seqlens_q=cu_q)
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    got = paged_attention(q, kc, vc, table, lens, cu_seqlens_q=cu_q, max_seqlen_q=max(q_lens), num_splits=splits,
                          k_scale=ks, v_scale=vs)
    native = paged_attention_native(q, kc, vc, table, lens, D**-0.5, cu_q, max(q_lens), k_scale=ks, v_scale=vs)
    tol = (2e-5 if dtype == torch.float32 else 4e-3) * max(want.abs().max().item(), 1.0)
    for name, out in (("triton", got), ("native", native)):
        assert out.dtype == dtype and (out.double() - want).abs().max().item() <= tol, f"{name} seed {seed}"
    exact = paged_attention_reference(q.double(), k64, v64, table, lens, cu_seqlens_q=cu_q)
    err = (got.double() - exact).abs().max().item() / exact.abs().max().item()
    print(f"fp8 cache vs the unquantised one: largest error {err:.3f} of the largest output")
    assert err < 0.25  # quantisation error only (measured 0.05-0.1; the keys' errors scale the logits')


@pytest.mark.parametrize("splits", [1, 2])
def test_small_values_keep_their_precision_under_fp16_queries(splits, monkeypatch, triton_kernels):
    # the kernel's dots run in fp16 under 16-bit queries: value scales as small as 1e-9 (values of 1e-6) must not
    # fall below fp16's normals in p (the scales relative to the tile's largest go into p), nor keys' into q k^T
    g = torch.Generator().manual_seed(random.randrange(2**31))
    lens = [37, 90]
    slots = torch.cat([torch.arange(37), 96 + torch.arange(90)]).to(torch.int32)
    table = torch.tensor([[0, 1, 2, -1, -1, -1], [6, 7, 8, 9, 10, 11]], dtype=torch.int32)
    mag = 10.0 ** -torch.randint(2, 7, (127, HKV, 1), generator=g).double()  # each head row 1e-2 .. 1e-6
    k, v = torch.randn(127, HKV, D, generator=g) * 3, torch.randn(127, HKV, D, generator=g).double() * mag
    (kc, vc), (ks, vs) = fp8_cache(12)
    store_kvcache(k, v.float(), kc, vc, slots, ks, vs)
    q = torch.randn(2, HKV * 2, D, generator=g).half()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = paged_attention_reference(q.double(), dequantized(kc, ks), dequantized(vc, vs), table, seq_lens)
    got = paged_attention(q, kc, vc, table, seq_lens, num_splits=splits, k_scale=ks, v_scale=vs)
    for b in range(2):  # each sequence against its own outputs' size (tiny where its values are)
        err = (got[b].double() - want[b]).abs().max() / want[b].abs().max()
        assert err < 2e-3, (b, err.item())


def test_fp8_cache_arguments_are_checked():
    (kc, vc), (ks, vs) = fp8_cache(2)
    q = torch.randn(1, HKV, D)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale and v_scale go together"):
        paged_attention(q, kc, vc, table, lens, k_scale=ks)
    with pytest.raises(ValueError, match="float8_e4m3fn with fp32 scales"):
        store_kvcache(q, q, kc.float(), vc.float(), torch.zeros(1, dtype=torch.int32), ks, vs)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(q, kc, vc, table, lens)  # an FP8 cache without its scales


def test_strided_scales_a_head_prefix_of_wider_rows(monkeypatch):
    """Scales viewed as the first HKV heads of [blocks, PAGE, HKV + 3] rows (and the cache as the first HKV * D of
    wider flat rows, as Gemma 4's layers view theirs): Triton's write and attention equal the native path's on
    contiguous tensors, and nothing past the prefix is touched."""
    g = torch.Generator().manual_seed(1)
    lens, n = [7, 21], 4
    slots = torch.cat([torch.arange(7), 32 + torch.arange(21)]).to(torch.int32)
    table, seq_lens = torch.tensor([[0, 3], [2, 3]], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    k, v = torch.randn(28, HKV, D, generator=g), torch.randn(28, HKV, D, generator=g)
    q = torch.randn(2, HKV * 2, D, generator=g)
    monkeypatch.setenv("ARENO_KERNELS", "native")
    (kc, vc), (ks, vs) = fp8_cache(n)
    store_kvcache(k, v, kc, vc, slots, ks, vs)
    want = paged_attention(q, kc, vc, table, seq_lens, k_scale=ks, v_scale=vs)
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    wide = [torch.zeros(n, PAGE, (HKV + 1) * D, dtype=FP8) for _ in range(2)]
    wide_s = torch.zeros(2, n, PAGE, HKV + 3)
    wide_s[..., HKV:] = 7.0  # the other heads' scales: left alone
    wk, wv = (w[..., : HKV * D].unflatten(-1, (HKV, D)) for w in wide)
    sk, sv = wide_s[0, ..., :HKV], wide_s[1, ..., :HKV]
    store_kvcache(k, v, wk, wv, slots, sk, sv)
    assert torch.equal(wk.view(torch.uint8), kc.view(torch.uint8)) and torch.equal(sk, ks) and torch.equal(sv, vs)
    assert (wide_s[..., HKV:] == 7.0).all() and (wide[0][..., HKV * D :].view(torch.uint8) == 0).all()
    got = paged_attention(q, wk, wv, table, seq_lens, k_scale=sk, v_scale=sv)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.gpu
def test_fp8_cache_on_the_gpu_bf16():
    """bf16 queries over an FP8 cache on a GPU: the cache write is the native one's bytes, attention its answer."""
    g = torch.Generator().manual_seed(0)
    seq_lens = [3, 200, 1000]
    need = [-(-n // PAGE) for n in seq_lens]
    table = torch.arange(len(seq_lens) * max(need), dtype=torch.int32).remainder(sum(need))  # blocks may be shared
    table = table.view(len(seq_lens), max(need)).cuda()
    slots = torch.arange(sum(need) * PAGE, dtype=torch.int32).cuda()
    k = torch.randn(len(slots), HKV, D, generator=g).cuda().bfloat16()
    v = torch.randn(len(slots), HKV, D, generator=g).cuda().bfloat16()
    caches = {}
    for mode in ("native", "triton"):
        (kc, vc), (ks, vs) = fp8_cache(sum(need))
        kc, vc, ks, vs = kc.cuda(), vc.cuda(), ks.cuda(), vs.cuda()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ARENO_KERNELS", mode)
            store_kvcache(k, v, kc, vc, slots, ks, vs)
        caches[mode] = (kc, vc, ks, vs)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8
                           else b) for a, b in zip(caches["native"], caches["triton"]))  # fmt: skip
    kc, vc, ks, vs = caches["triton"]
    q = torch.randn(len(seq_lens), HKV * 4, D, generator=g).cuda().bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    got = paged_attention(q, kc, vc, table, lens, k_scale=ks, v_scale=vs)
    ref = paged_attention_native(q, kc, vc, table, lens, D**-0.5, None, 1, k_scale=ks, v_scale=vs)
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
