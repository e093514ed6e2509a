"""Block bookkeeping: allocation, prefix-cache reuse and eviction, fork with copy-on-write, full release."""

from areno.config import SamplingParams
from areno.engine.block_manager import BlockManager
from areno.engine.sequence import Sequence


def seq(tokens):
    return Sequence(list(tokens), SamplingParams(max_new_tokens=8))


def computed(bm, s):
    s.num_computed = len(s)
    bm.commit(s)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(10, 4)
    a, b = seq(range(9)), seq(range(100, 103))
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1 and bm.num_free == 6
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free == 10 and all(r == 0 for r in bm.ref_count)


def test_prefix_cache_reuses_full_blocks_but_recomputes_the_last_token():
    bm = BlockManager(16, 4)
    a = seq(range(12))
    bm.allocate(a)
    computed(bm, a)
    b = seq(list(range(12)) + [99])
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3] and b.num_computed == 12
    c = seq(range(12))  # identical prompt: the last block is recomputed so its logits exist
    bm.allocate(c)
    assert c.num_computed == 8 and c.block_table[:2] == a.block_table[:2] and c.block_table[2] != a.block_table[2]
    for s in (a, b, c):
        bm.free_seq(s)
    assert bm.num_free == 16
    d = seq(list(range(8)) + [7, 7, 7, 7, 1])  # hits the freed-but-cached blocks
    bm.allocate(d)
    assert d.num_computed == 8 and bm.prefix_hits == 12 + 8 + 8
    assert bm.prefix_queries == 12 + 13 + 12 + 13  # every prompt token allocated is a query


def test_prefix_counters_stay_zero_without_prefix_caching():
    bm = BlockManager(16, 4, prefix_caching=False)
    for _ in range(2):
        s = seq(range(12))
        bm.allocate(s)
        computed(bm, s)
        bm.free_seq(s)
    assert bm.prefix_queries == bm.prefix_hits == 0


def test_eviction_under_pressure_drops_hashes():
    bm = BlockManager(3, 2)
    a = seq(range(5))
    bm.allocate(a)
    computed(bm, a)
    bm.free_seq(a)
    b = seq(range(50, 55))  # needs all three blocks, evicting the cached ones
    bm.allocate(b)
    assert bm.num_free == 0 and not bm.cached
    bm.free_seq(b)
    assert bm.num_free == 3


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    bm = BlockManager(8, 4)
    parent = seq(range(6))
    bm.allocate(parent)
    computed(bm, parent)
    child = seq(range(6))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.ref_count[parent.block_table[1]] == 2
    for s in (parent, child):
        s.append(1, 0.0)
    assert bm.prepare_append(parent)
    (src, dst), = bm.pending_copies
    assert src == child.block_table[1] and parent.block_table[1] == dst
    assert bm.prepare_append(child) and child.block_table[1] == src and len(bm.pending_copies) == 1
    bm.free_seq(parent)
    bm.free_seq(child)
    assert bm.num_free == 8


def test_admission_counts_the_unforked_siblings_of_running_heads():
    """Two n=2 requests waiting, five sequences running, eight state slots: the first head's sibling takes a slot once
    its prompt is computed, so the second group (2 more) waits; admitting both forked a ninth sequence past the eight
    slots ("no recurrent-state slot free", seen under speculation's timing on the GPU)."""
    from areno.engine.scheduler import Scheduler

    bm = BlockManager(64, 4, state_slots=8)
    sched = Scheduler(bm, max_running=8, max_batched_tokens=64, max_model_len=64)
    for i in range(5):
        sched.add([seq(range(10 * i, 10 * i + 3))])
    sched.after_step(sched.schedule())
    groups = [[Sequence(list(range(200 + 5 * g, 203 + 5 * g)), SamplingParams(max_new_tokens=8), sample_index=j)
               for j in range(2)] for g in range(2)]
    for group in groups:
        sched.add(group)
    step = sched.schedule()
    assert [c.seq for c in step.chunks if c.seq.prompt_len == 3 and c.seq in groups[1]] == []
    for c in step.chunks:
        c.samples = c.end == len(c.seq)
    sched.after_step(step)
    assert len(sched.running) == 7 and len(bm.free_state_slots) == 1 and sched.waiting[0] is groups[1][0]
    assert not sched.can_admit()
