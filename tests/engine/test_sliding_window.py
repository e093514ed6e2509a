"""Sliding-window layers in the paged KV cache: KV-cache groups, blocks dropped left of the window and reused by
other sequences, prefix hits cut to what every group holds, and OLMo 3 greedy rollouts equal to transformers."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from areno.config import SamplingParams
from areno.engine.block_manager import BlockManager
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block, kv_groups, window_blocks
from areno.engine.sequence import Sequence
from areno.models import load_model, load_tokenizer
from areno.models.olmo3 import Olmo3ForCausalLM
from areno.testing import make_tiny_checkpoint

S, F = "sliding_attention", "full_attention"


def seq(tokens):
    return Sequence(list(tokens), SamplingParams(max_new_tokens=8))


def alloc(bm, s):
    """What the scheduler does to admit ``s`` and give its (whole) first prefill chunk blocks."""
    bm.allocate(s)
    assert bm.reserve_tokens(s, len(s))


def step(bm, s):
    """What the scheduler does after a step that computed all of ``s``'s tokens but the newest."""
    s.num_computed = len(s) - 1 if s.num_computed else len(s)
    bm.commit(s)
    bm.trim(s)


def test_kv_groups_split_the_layers_by_window():
    def model(windows, kv_layers=None):
        return SimpleNamespace(layer_windows=windows, kv_cache_layers=kv_layers or list(range(len(windows))))

    olmo3_7b = [None if (i + 1) % 4 == 0 else 4096 for i in range(32)]  # 3 sliding : 1 full
    groups = kv_groups(model(olmo3_7b), 65536)
    assert [g.window for g in groups] == [None, 4096, 4096, 4096]
    assert groups[0].layers == list(range(3, 32, 4)) and all(len(g.layers) == 8 for g in groups)
    assert sorted(i for g in groups for i in g.layers) == list(range(32))
    assert kv_groups(model([None] * 6)) == [(None, list(range(6)))]  # no window: one group, as before
    assert kv_groups(model([8, None, 8] * 2), 8) == [(None, list(range(6)))]  # window >= context: full attention
    assert kv_groups(model([None, 2, 2, 2, 2], [0, 1, 3])) == [(None, [0]), (2, [1]), (2, [3])]  # cache layers only


def test_a_sliding_group_holds_its_window_while_the_sequence_grows():
    bm = BlockManager(64, 4, windows=(None, 8))
    s = seq(range(10))
    alloc(bm, s)
    assert len(s.tables) == 2 and bm.held(s, 0) == bm.held(s, 1) == 3
    held = []
    for t in range(60):
        step(bm, s)
        s.append(t, 0.0)
        assert bm.prepare_append(s)
        held.append(bm.held(s, 1))
        assert bm.held(s, 0) == bm.blocks_for(len(s))  # the full group keeps every block
        assert all(b == 0 for b in s.tables[1][: s.dropped[1]])  # dropped entries read block 0
    assert max(held) <= window_blocks(8, 4) == 3 and bm.num_used == bm.held(s, 0) + bm.held(s, 1)
    bm.free_seq(s)
    assert bm.num_free == 64 and not any(bm.ref_count)


def test_dropped_blocks_serve_other_sequences():
    bm = BlockManager(12, 4, windows=(None, 4), prefix_caching=False)
    a = seq(range(20))  # 5 blocks in each group
    alloc(bm, a)
    assert bm.num_free == 2 and not bm.can_allocate(8)
    step(bm, a)  # the next query (token 20) sees tokens 17..20: blocks 0..3 of the sliding group are dropped
    assert a.dropped == [0, 4] and bm.num_free == 6
    b = seq(range(100, 108))
    assert bm.can_allocate(len(b))
    alloc(bm, b)
    for s in (a, b):
        bm.free_seq(s)
    assert bm.num_free == 12


def test_a_prefix_hit_is_cut_to_what_every_group_still_holds():
    bm = BlockManager(24, 4, windows=(None, 8))
    a = seq(range(21))
    alloc(bm, a)
    step(bm, a)  # registers blocks 0..4 in both groups, then drops sliding blocks 0..2 (they keep their hash)
    assert a.dropped == [0, 3]
    filler = seq(range(100, 100 + 4 * (bm.num_free // 2)))  # takes the free blocks: evicts the dropped ones
    alloc(bm, filler)
    bm.free_seq(filler)
    # resuming at token 20 needs sliding blocks 3 and 4 (keys 13..19), which a still holds: a full hit
    b = seq(list(range(20)) + [99])
    alloc(bm, b)
    assert b.num_computed == 20 and b.dropped == [0, 3] and b.tables[1][3:5] == a.tables[1][3:5]
    assert b.tables[0][:5] == a.tables[0][:5]
    # resuming at token 12 (or 8, 4) needs sliding blocks the filler evicted: nothing is reused
    c = seq(range(13))
    alloc(bm, c)
    assert c.num_computed == 0 and c.dropped == [0, 0] and bm.prefix_hits == 20
    for s in (a, b, c):
        bm.free_seq(s)
    assert bm.num_free == 24 and not any(bm.ref_count)


def test_fork_shares_both_groups_and_copies_on_write():
    bm = BlockManager(32, 4, windows=(None, 4))
    parent = seq(range(14))
    alloc(bm, parent)
    step(bm, parent)
    child = seq(range(14))
    bm.fork(parent, child)
    assert child.tables == parent.tables and child.dropped == parent.dropped == [0, 2]
    for s in (parent, child):
        s.append(7, 0.0)
        assert bm.prepare_append(s)
    assert len(bm.pending_copies) == 2  # the shared last block of each group, copied once
    assert child.tables[0][3] != parent.tables[0][3] and child.tables[1][3] != parent.tables[1][3]
    for s in (parent, child):
        bm.free_seq(s)
    assert bm.num_free == 32


@pytest.mark.parametrize("native", [True, False], ids=["native", "triton-interpreted"])
def test_paged_attention_reads_nothing_from_dropped_table_entries(native):
    """Table entries left of the window point at block 0 (garbage here): the paged paths, native and the Triton
    kernel (interpreted; it may load a block left of the window and mask it), give the intact table's result."""
    from areno.kernels.attention.paged import (
        paged_attention_native,
        paged_attention_reference,
        paged_attention_triton,
    )

    torch.manual_seed(4)
    page, hkv, hq, d, window = 4, 2, 4, 16, 6
    lens, nq = [37, 22], [3, 5]
    need = [-(-n // page) for n in lens]
    kc, vc = (torch.randn(1 + sum(need), page, hkv, d) for _ in range(2))
    kc[0], vc[0] = 1e4, -1e4  # block 0: what dropped entries read
    table = torch.zeros(2, max(need), dtype=torch.int32)
    table[0, : need[0]] = torch.arange(1, 1 + need[0])
    table[1, : need[1]] = torch.arange(1 + need[0], 1 + sum(need))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for cu_q, q in ((None, torch.randn(2, hq, d)),
                    (torch.tensor([0] + nq).cumsum(0).to(torch.int32), torch.randn(sum(nq), hq, d))):
        first = [n - (1 if cu_q is None else k) for n, k in zip(lens, nq)]  # each sequence's first query position
        dropped = table.clone()
        for b, pos in enumerate(first):
            dropped[b, : max(0, pos - window + 1) // page] = 0
        assert (dropped == 0).sum() > 4
        want = paged_attention_reference(q.double(), kc.double(), vc.double(), table, seq_lens, cu_seqlens_q=cu_q,
                                         window=window)
        max_q = 5 if cu_q is not None else 1
        got = (paged_attention_native(q, kc, vc, dropped, seq_lens, d ** -0.5, cu_q, max_q, window) if native else
               paged_attention_triton(q, kc, vc, dropped, seq_lens, d ** -0.5, cu_q, max_q, num_splits=2,
                                      window=window, config=(64, 16, 4, 1)))
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


# ---- the engine on OLMo 3 ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def olmo3(tmp_path_factory):
    """Window 6, [sliding, full, sliding]: two sliding groups and one full group of one layer each."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("o3w"), family="olmo3", seed=5, num_hidden_layers=3,
                                sliding_window=6, layer_types=[S, F, S])
    model = load_model(path, dtype=torch.float32, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, load_tokenizer(path), hf


def engine(model, tok, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_running", 8)
    return Engine(model, tok, EngineConfig(**kw))


def reference(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


LONG = ["the quick brown fox jumps over the lazy dog " * 3, "a", "numbers: 1 2 3 4 5 6 7 8 9 10 11 12", "hi there"]


def test_a_model_without_windows_keeps_one_group_and_the_layout_of_before(tmp_path):
    path = make_tiny_checkpoint(tmp_path, family="qwen3", seed=1)
    model, tok = load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)
    e = engine(model, tok)
    assert model.layer_windows == [None] * model.num_layers and e.blocks.windows == [None] and not e.blocks.sliding
    assert e.runner.layer_groups is None and e.runner.kv_cache.shape[0] == model.num_layers
    (s,) = e.add_request(tok.encode("hello there"), SamplingParams(max_new_tokens=3))
    step = e.scheduler.schedule()
    inp = e.runner.prepare(step, [s], [len(s) - 1], [])
    assert inp.group_tables is None and inp.group_slots is None and len(s.tables) == 1


def test_greedy_equals_transformers_with_chunks_preemption_and_samples(olmo3):
    model, tok, hf = olmo3
    prompts = [tok.encode(p) for p in LONG]
    opts = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, n=2)
    ref = [reference(hf, p, 16) for p in prompts]
    per_block = kv_bytes_per_block(model, 4, torch.float32, 256)
    # chunked prefill (a head can finish its prompt in a decode-like step with its samples unforked) under a cache
    # so small that sequences are preempted and recomputed; then k-step decode (the CUDA-graph code, eager here)
    for kw in ({"max_batched_tokens": 7, "kv_cache_memory": 36 * per_block}, {"decode_steps": 4}):
        e = engine(model, tok, **kw)
        assert e.blocks.windows == [None, 6, 6]
        out = e.generate(prompts, opts)
        assert [[c.token_ids for c in g] for g in out] == [[r, r] for r in ref], kw
        assert e.blocks.num_free == e.blocks.num_blocks and not any(e.blocks.ref_count)
        assert e.scheduler.num_preemptions > 0 or "decode_steps" in kw


def test_prefix_hits_resume_from_the_blocks_every_group_holds(olmo3):
    model, tok, hf = olmo3
    e = engine(model, tok)
    prefix = tok.encode(LONG[0])
    opts = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    for tail in (" one", " two", ""):
        prompt = prefix + tok.encode(tail)
        hits = e.blocks.prefix_hits
        (g,) = e.generate([prompt], opts)
        assert g[0].token_ids == reference(hf, prompt, 12), tail
        if tail != " one":
            assert e.blocks.prefix_hits - hits >= (len(prefix) - 1) // 4 * 4 - 4
    # the sliding groups' cached blocks evicted, the full group's kept: no prefix every group can resume from, so
    # the prompt is recomputed (not resumed over blocks the sliding layers lost)
    bm = e.blocks
    for key in [key for key in bm.cached if isinstance(key, tuple)]:
        bm.block_hash[bm.cached.pop(key)] = None
    assert bm.cached
    prompt, hits = prefix + tok.encode(" three"), bm.prefix_hits
    (g,) = e.generate([prompt], opts)
    assert bm.prefix_hits == hits and g[0].token_ids == reference(hf, prompt, 12)


def test_more_sequences_fit_in_the_same_cache(olmo3, monkeypatch):
    """The same bytes of cache: with the window's blocks dropped eight long sequences decode side by side; with
    every block kept (no windows told to the engine) the scheduler has to preempt."""
    model, tok, hf = olmo3
    per_block = kv_bytes_per_block(model, 4, torch.float32, 256)  # one layer a block: the groups' block
    prompts = [tok.encode(f"sequence {i} says") for i in range(8)]
    opts = SamplingParams(temperature=0.0, max_new_tokens=28, ignore_eos=True)
    runs = {}
    for windows in (True, False):
        if not windows:
            monkeypatch.setattr(Olmo3ForCausalLM, "layer_windows", property(lambda self: [None] * 3))
        e = engine(model, tok, kv_cache_memory=3 * 50 * per_block)
        out = e.generate(prompts, opts)
        runs[windows] = (e.scheduler.num_preemptions, [g[0].token_ids for g in out])
    assert runs[True][0] == 0 < runs[False][0]
    assert runs[True][1] == runs[False][1]


@pytest.mark.gpu
def test_cuda_graph_decode_with_kv_groups_matches_one_group(tmp_path, monkeypatch):
    """On the GPU (bf16, CUDA graphs): decode graphs carry every group's block table. One-step and 8-step graphs with
    the window's blocks dropped give exactly the tokens of the same graphs over one group that keeps every block
    (the same kernels on other blocks), on a window (16) much shorter than the sequences."""
    path = make_tiny_checkpoint(tmp_path, family="olmo3", seed=6, num_hidden_layers=4, sliding_window=16,
                                layer_types=[S, S, S, F])
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    tok = load_tokenizer(path)
    prompts = [tok.encode("more text " * i) for i in range(1, 12)]
    opts = SamplingParams(temperature=0.0, max_new_tokens=80, ignore_eos=True, n=2)
    outs = []
    for windows in (True, False):
        if not windows:
            monkeypatch.setattr(Olmo3ForCausalLM, "layer_windows", property(lambda self: [None] * 4))
        for k in (1, 8):
            eng = engine(model, tok, block_size=16, max_running=32, decode_steps=k)
            assert eng.blocks.windows == ([None, 16, 16, 16] if windows else [None])
            outs.append([[c.token_ids for c in g] for g in eng.generate(prompts, opts)])
            assert eng.runner.last_step_used_graph and any(key[1] == k for key in eng.runner.graphs)
    assert all(o == outs[0] for o in outs)
