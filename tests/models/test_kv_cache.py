"""The paged KV-cache path (prefill, decode, prefill over a cached prefix) gives the plain full forward's logits."""

import pytest
import torch
from hf_reference import FAMILIES

from areno.models import AttentionMetadata, load_model

BLOCK = 4


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


class Cache:
    """A hand-built paged cache: per-sequence block lists (deliberately not contiguous)."""

    def __init__(self, model, num_blocks=16):
        shape = model.kv_cache_shape(num_blocks, BLOCK)
        dtype = model.embed_tokens.weight.dtype
        zeros = lambda: torch.zeros(shape, dtype=dtype)  # noqa: E731
        self.layers = [(zeros(), zeros()) for _ in range(model.num_layers)]

    @staticmethod
    def slots(blocks, start, end):
        return [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]

    def step(self, model, seqs, tables, starts, ends, *, decode):
        """Run tokens ``[start, end)`` of each sequence (its keys before ``start`` already cached)."""
        ids = torch.cat([s[a:b] for s, a, b in zip(seqs, starts, ends)])
        pos = torch.cat([torch.arange(a, b) for a, b in zip(starts, ends)])
        slots = sum((self.slots(t, a, b) for t, a, b in zip(tables, starts, ends)), [])
        q_lens = [b - a for a, b in zip(starts, ends)]
        cu_q = _i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            is_prefill=not decode,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=None if decode else _i32([0] + torch.tensor(ends).cumsum(0).tolist()),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(ends),
            block_table=_i32([t + [0] * (width - len(t)) for t in tables]),
            seq_lens=_i32(ends),
            has_prefix=any(a > 0 for a in starts) and not decode,
        )
        return model.compute_logits(model(ids, pos, kv_caches=self.layers, attn_metadata=meta))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_matches_full_forward(tiny_checkpoint, family):
    model = load_model(tiny_checkpoint(family), device="cpu")
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 1000, (10,), generator=gen), torch.randint(0, 1000, (8,), generator=gen)
    tables = [[3, 7, 12], [1, 10]]
    cache = Cache(model)
    with torch.inference_mode():
        full_a, full_b = model.logits(a[None])[0], model.logits(b[None])[0]
        scale = full_a.abs().max()
        got = cache.step(model, [a, b], tables, [0, 0], [7, 5], decode=False)
        want = torch.cat([full_a[:7], full_b[:5]])
        assert (got - want).abs().max() <= 1e-5 * scale
        for j in range(3):  # decode one token per sequence
            got = cache.step(model, [a, b], tables, [7 + j, 5 + j], [8 + j, 6 + j], decode=True)
            want = torch.stack([full_a[7 + j], full_b[5 + j]])
            assert got.shape == (2, model.config.vocab_size)
            assert (got - want).abs().max() <= 1e-5 * scale, j


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "olmo2", "olmo3"])  # olmo3: window 4 < 10 tokens
def test_prefill_over_cached_prefix_matches_full_forward(tiny_checkpoint, family):
    """Two sequences reuse the first cached block of two others (prompt sharing) and prefill only their tail."""
    model = load_model(tiny_checkpoint(family), device="cpu")
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 1000, (7,), generator=gen), torch.randint(0, 1000, (5,), generator=gen)
    c = torch.cat([a[:4], torch.randint(0, 1000, (6,), generator=gen)])
    d = torch.cat([b[:4], torch.randint(0, 1000, (3,), generator=gen)])
    cache = Cache(model)
    with torch.inference_mode():
        cache.step(model, [a, b], [[3, 7], [1, 10]], [0, 0], [7, 5], decode=False)
        got = cache.step(model, [c, d], [[3, 5, 6], [1, 9]], [4, 4], [10, 7], decode=False)
        want = torch.cat([model.logits(c[None])[0, 4:], model.logits(d[None])[0, 4:]])
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        got = cache.step(model, [c, d], [[3, 5, 6], [1, 9]], [9, 6], [10, 7], decode=True)  # re-decode the last
        assert (got - want[[5, 8]]).abs().max() <= 1e-5 * want.abs().max()


def test_cache_sizes_for_the_engine(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3"), device="cpu")
    cfg = model.config
    assert model.num_layers == cfg.num_layers == 2
    assert model.head_dim == cfg.head_dim and model.num_kv_heads_local == cfg.num_kv_heads
    assert model.kv_cache_shape(32, 16) == (32, 16, cfg.num_kv_heads, cfg.head_dim)


def test_padding_slots_are_not_written(tiny_checkpoint):
    """Decode rows with slot -1 (CUDA-graph padding) leave the cache untouched."""
    model = load_model(tiny_checkpoint("llama"), device="cpu")
    cache = Cache(model)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, -1]), is_prefill=False, cu_seqlens_q=_i32([0, 1, 2]), max_seqlen_q=1,
        max_seqlen_k=4, block_table=_i32([[1], [0]]), seq_lens=_i32([2, 1]),
    )  # fmt: skip
    with torch.inference_mode():
        model(torch.tensor([3, 4]), torch.tensor([1, 0]), kv_caches=cache.layers, attn_metadata=meta)
    k = cache.layers[0][0]
    assert k[1, 1].abs().sum() > 0
    assert k[0].abs().sum() == 0 and k[1, 0].abs().sum() == 0 and k[2:].abs().sum() == 0
