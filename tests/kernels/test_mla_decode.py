"""mla_decode() and store_latent(): Triton (interpreted on CPU) and native paths against a float64 oracle; the
absorbed form equals attention over K/V expanded per head."""

from __future__ import annotations

import pytest
import torch

from areno.kernels.attention.mla import mla_decode, mla_decode_native, mla_decode_reference, store_latent
from areno.kernels.attention.paged import paged_attention_reference

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def make_cache(seq_lens, width, page, dtype, g, device="cpu", spare_blocks=3):
    """A random latent cache whose blocks are scattered at random; table entries past a sequence's blocks are -1."""
    need = [-(-n // page) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    cache = torch.randn(num_blocks, page, width, generator=g).to(device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    return cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def check(q, cache, table, lens, rank, scale, tol, num_splits=None):
    want = mla_decode_reference(q.double(), cache.double(), table, lens, kv_lora_rank=rank, softmax_scale=scale)
    got = mla_decode(q, cache, table, lens, kv_lora_rank=rank, softmax_scale=scale, num_splits=num_splits)
    native = mla_decode_native(q, cache, table, lens, rank, scale)
    bound = tol * max(want.abs().max().item(), 1.0)
    for name, out in (("triton", got), ("native", native)):
        assert out.shape == (q.shape[0], q.shape[1], rank) and out.dtype == q.dtype, name
        assert torch.isfinite(out).all(), name
        err = (out.double() - want.to(out.device)).abs().max().item()
        assert err <= bound, (name, err, bound)


@pytest.mark.parametrize(
    "lens, heads, rank, rope, page, splits",
    [
        ([5, 1, 37], 4, 32, 8, 4, None),  # context lengths off the block size, a 1-token sequence
        ([70, 13], 3, 24, 6, 16, 2),  # odd head count and widths (masked), split-K with a merge
        ([9, 33, 64, 2], 16, 48, 16, 8, 4),  # more splits than some sequences have key tiles
    ],
)
def test_triton_and_native_match_float64(triton_kernels, lens, heads, rank, rope, page, splits):
    g = torch.Generator().manual_seed(len(lens) * 7 + heads)
    cache, table, seq_lens = make_cache(lens, rank + rope, page, torch.float32, g)
    q = torch.randn(len(lens), heads, rank + rope, generator=g)
    check(q, cache, table, seq_lens, rank, (rank + rope) ** -0.5 * 1.7, TOL[torch.float32], num_splits=splits)


def test_split_rows_chooses_the_split_for_that_many_sequences(triton_kernels, monkeypatch):
    """As paged_attention's: a speculative verify's rows split their keys as a decode of its sequences does."""
    from areno.kernels.attention import mla

    seen = []
    monkeypatch.setattr(mla, "num_splits_for", lambda q, programs, keys: seen.append(programs) or 1)
    g = torch.Generator().manual_seed(1)
    cache, table, seq_lens = make_cache([20, 21, 22, 5], 24 + 8, 8, torch.float32, g)
    q = torch.randn(4, 2, 24 + 8, generator=g)
    base = mla_decode(q, cache, table, seq_lens, kv_lora_rank=24)
    same = mla_decode(q, cache, table, seq_lens, kv_lora_rank=24, split_rows=2)
    assert seen[1] * 2 == seen[0] and torch.equal(base, same)


def test_absorbed_equals_expanded_heads():
    """``q_lat = q_nope W_uk`` against the latent rows, then ``W_uv o_lat``, equals attention over per-head keys
    ``[W_uk c | k_rope]`` and values ``W_uv c`` (float64, the identity the model's decode relies on)."""
    g = torch.Generator().manual_seed(3)
    lens, heads, rank, rope, nope, dv, page = [11, 4], 3, 20, 6, 10, 7, 4
    cache, table, seq_lens = make_cache(lens, rank + rope, page, torch.float64, g)
    w_uk = torch.randn(heads, nope, rank, generator=g, dtype=torch.float64)
    w_uv = torch.randn(heads, dv, rank, generator=g, dtype=torch.float64)
    q = torch.randn(len(lens), heads, nope + rope, generator=g, dtype=torch.float64)
    scale = (nope + rope) ** -0.5
    q_abs = torch.cat([torch.einsum("bhn,hnr->bhr", q[..., :nope], w_uk), q[..., nope:]], dim=-1)
    o_lat = mla_decode(q_abs, cache, table, seq_lens, kv_lora_rank=rank, softmax_scale=scale)
    got = torch.einsum("bhr,hvr->bhv", o_lat, w_uv)
    c, kr = cache[..., :rank], cache[..., rank:]
    k = torch.cat([torch.einsum("bsr,hnr->bshn", c, w_uk), kr[:, :, None].expand(-1, -1, heads, -1)], dim=-1)
    v = torch.einsum("bsr,hvr->bshv", c, w_uv)
    width = nope + rope
    v = torch.nn.functional.pad(v, (0, width - dv))
    want = paged_attention_reference(q, k, v, table, seq_lens, softmax_scale=scale)[..., :dv]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernels", ["triton_kernels", "native_kernels"])
def test_store_latent_writes_slots_and_skips_padding(kernels, request):
    request.getfixturevalue(kernels)
    cache = torch.zeros(3, 4, 10)
    x = torch.randn(5, 10)
    slots = torch.tensor([6, -1, 0, 11, -1])
    store_latent(x, cache, slots)
    flat = cache.view(-1, 10)
    for row, s in zip(x, slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], row)
    written = {s for s in slots.tolist() if s >= 0}
    assert all((flat[s] == 0).all() for s in range(12) if s not in written)
    store_latent(x[:2], cache, torch.tensor([-1, -1]))  # nothing valid: nothing changes
    assert all((flat[s] == 0).all() for s in range(12) if s not in written)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, splits", [(32, None), (16, None), (32, 8), (5, 1)])
def test_bf16_on_gpu(heads, splits):
    """Ling 3's widths (R = 512, P = 64) in bf16: the Triton kernel against float64, with and without split-K."""
    g = torch.Generator().manual_seed(heads)
    lens = [1, 17, 300, 1029, 4096, 77]
    cache, table, seq_lens = make_cache(lens, 576, 16, torch.bfloat16, g, device="cuda")
    q = torch.randn(len(lens), heads, 576, generator=g).to("cuda", torch.bfloat16)
    check(q, cache, table, seq_lens, 512, 192**-0.5, TOL[torch.bfloat16], num_splits=splits)
