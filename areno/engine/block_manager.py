"""Paged KV-cache bookkeeping: block allocation, prefix caching by block hash, fork and copy-on-write.

The cache holds ``num_blocks`` blocks of ``block_size`` token slots. A block is shared by reference count:
- the n samples of one prompt fork from the first sample after its prefill and share all its blocks; the last,
  partly filled block is copied (copy-on-write) by whichever sample writes into it first while it is shared;
- a full block whose K/V are computed is registered under a hash chained over all tokens up to its end (and the
  content hashes of the images whose tokens it holds), so a later request with the same prefix reuses it. Freed
  blocks keep their hash and sit in an LRU free list until a new allocation evicts them. A sequence served with a
  LoRA adapter starts its chain from that adapter load's key (``seq.lora_key``; 0 for the base model), so K/V
  computed under one adapter never serve another.
No device memory is touched here; copies are queued in ``pending_copies`` for the model runner.

Sliding-window layers (``windows``, one entry per KV-cache group, see ``kv_cache.kv_groups``): every group keeps
its own block table per sequence (``seq.tables``), all drawing from the one pool. After each step a sliding group
drops the blocks that lie wholly left of the window of the sequence's next query (``trim``), so it holds at most
``ceil(W / block_size) + 1`` blocks while decoding; a dropped block goes back to the free list (keeping its
hash). Prefix caching registers each full block per group (key: the chain hash, and the group for g > 0); a hit
of L blocks needs every full group to hold blocks 0..L-1 and every sliding group the blocks the query at token
L * block_size still sees, so a hit is cut to the longest prefix all groups can resume from (the rest recomputes).
A model without windows has one group: everything below then does what it did before groups.

Hybrid models (``state_slots`` > 0): each sequence also holds a recurrent-state slot (``seq.state_slot``) from
allocation to free; a fork gives the child its own slot and queues the copy of the parent's state in
``pending_state_copies`` (see ``state_cache.py``).
"""

from __future__ import annotations

from collections import OrderedDict

from areno.engine.kv_cache import window_blocks
from areno.engine.sequence import Sequence


def _chain_hash(prev: int, tokens) -> int:
    return hash((prev, tuple(tokens)))


def _with_images(seq: Sequence, tokens: list[int], start: int) -> list:
    """A block's key material: its tokens, and for a block holding image tokens the images' content hashes (the
    placeholder ids are the same for every image, so two prompts with other images never share the block)."""
    extra = seq.mm.ids_in(start, start + len(tokens))
    return tokens + [extra] if extra else tokens


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, state_slots: int = 0,
                 windows: tuple = (None,)):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one slot")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.windows = list(windows)  # per KV-cache group: its sliding window, None for full attention
        self.sliding = [g for g, w in enumerate(self.windows) if w is not None]
        self.full = [g for g, w in enumerate(self.windows) if w is None]
        self.ref_count = [0] * num_blocks
        self.block_hash: list = [None] * num_blocks  # its key in ``cached``
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict = {}  # chained hash (group 0) or (group, chained hash) -> block id
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the runner
        self.num_state_slots = state_slots
        self.free_state_slots = list(range(state_slots))[::-1]
        self.pending_state_copies: list[tuple[int, int]] = []  # (src, dst) recurrent-state slot copies
        # prefix-cache counters for /metrics and tests (hit rate = hits / queries): prompt tokens looked up at
        # allocation (a recomputed preempted sequence counts again), and those served from the cache
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._hashed: dict[int, tuple[int, int]] = {}  # seq_id -> (blocks hashed so far, last chain hash)

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _sliding_need(self, window: int, num_tokens: int, chunk: int) -> int:
        """Blocks a sliding group needs for a prefill chunk of ``chunk`` tokens (its keys and the window before)."""
        return min(self.blocks_for(num_tokens), self.blocks_for(min(num_tokens, chunk) + window - 1) + 1)

    def peak_blocks(self, prompt_len: int, total: int, chunk: int) -> int:
        """Blocks a sequence of ``prompt_len`` prompt tokens growing to ``total`` holds at most, all groups, with
        prefill chunks of at most ``chunk`` tokens: a sliding group holds a chunk and its window, then its window."""
        full = self.blocks_for(total)
        return sum(full if w is None else min(full, max(self._sliding_need(w, prompt_len, chunk),
                                                        window_blocks(w, self.block_size))) for w in self.windows)

    def held(self, seq: Sequence, group: int = 0) -> int:
        """Blocks ``seq`` holds in ``group``."""
        return len(seq.tables[group]) - seq.dropped[group]

    def _key(self, group: int, chain: int):
        return chain if group == 0 else (group, chain)

    def _first_needed(self, group: int, pos: int) -> int:
        """The first block of ``group``'s table that a query at token ``pos`` reads (0 for full attention)."""
        w = self.windows[group]
        return 0 if w is None else max(0, pos - w + 1) // self.block_size

    # ---- allocation ----------------------------------------------------------------------------------------
    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:  # evict it from the prefix cache
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hash[block] = None
        self.ref_count[block] = 1
        return block

    def _ref(self, block: int) -> int:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1
        return block

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, "block freed twice"
        if self.ref_count[block] == 0:
            self.free[block] = None
            if self.block_hash[block] is None:  # nothing to keep: reuse it first
                self.free.move_to_end(block, last=False)

    def can_allocate(self, num_tokens: int, reserve: int = 0, chunk: int | None = None) -> bool:
        """Room for a prompt of ``num_tokens`` (a sliding group: its first ``chunk`` tokens) in every group, plus
        ``reserve`` blocks per group."""
        if not self.sliding:
            return (self.blocks_for(num_tokens) + reserve) * len(self.windows) <= self.num_free
        chunk = num_tokens if chunk is None else chunk
        need = sum(self.blocks_for(num_tokens) if w is None else self._sliding_need(w, num_tokens, chunk)
                   for w in self.windows)
        return need + reserve * len(self.windows) <= self.num_free

    def _cached_chain(self, seq: Sequence) -> list[int]:
        """Chain hashes of the prompt's leading full blocks that every full-attention group holds, up to the first
        miss (never the block of the last token: its logits are needed)."""
        bs, tokens, mm = self.block_size, seq.tokens, seq.mm
        out, prev = [], seq.lora_key  # a LoRA adapter's K/V differ from the base's: its own chain
        for i in range((len(tokens) - 1) // bs):
            chunk = tokens[i * bs : (i + 1) * bs]
            prev = _chain_hash(prev, chunk if mm is None else _with_images(seq, chunk, i * bs))
            if not all(self._key(g, prev) in self.cached for g in self.full):
                break
            out.append(prev)
        return out

    def _longest_hit(self, chain: list[int]) -> int:
        """Blocks of ``chain`` every group can resume from: the sliding groups hold the ones the first recomputed
        query still sees."""
        n = len(chain)
        while n and not all(self._key(g, chain[i]) in self.cached for g in self.sliding
                            for i in range(self._first_needed(g, n * self.block_size), n)):
            n -= 1
        return n

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached full blocks of its prefix; a sliding group only
        the cached blocks it resumes from (``reserve_tokens`` gives each prefill chunk its blocks).

        At least the last token is always left to compute, since its logits give the next token.
        """
        assert not seq.block_table, "sequence already holds blocks"
        self._take_state_slot(seq)
        chain = self._cached_chain(seq) if self.prefix_caching else []
        hit = self._longest_hit(chain) if self.sliding else len(chain)
        n_blocks = self.blocks_for(len(seq.tokens))
        seq.tables, seq.dropped = [], []
        for g in range(len(self.windows)):
            skip = self._first_needed(g, hit * self.block_size)
            table = [0] * skip
            table += [self._ref(self.cached[self._key(g, chain[i])]) for i in range(skip, hit)]
            if self.windows[g] is None:
                table += [self._take_free() for _ in range(hit, n_blocks)]
            seq.tables.append(table)
            seq.dropped.append(skip)
        seq.num_computed = seq.num_cached = seq.prefix_cached = hit * self.block_size
        if self.prefix_caching:
            self.prefix_queries += len(seq.tokens)
        self.prefix_hits += seq.num_cached
        self._hashed[seq.seq_id] = (hit, chain[hit - 1] if hit else seq.lora_key)

    def free_seq(self, seq: Sequence) -> None:
        for table, dropped in zip(seq.tables, seq.dropped):
            for block in reversed(table[dropped:]):
                self._release(block)
        seq.tables, seq.dropped = [[] for _ in self.windows], [0] * len(self.windows)
        seq.num_computed = seq.num_cached = 0
        self._hashed.pop(seq.seq_id, None)
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1

    def trim(self, seq: Sequence) -> None:
        """Drop the blocks of each sliding group that lie wholly left of the window of ``seq``'s next query (at
        token ``num_computed``); they return to the free list."""
        for g in self.sliding:
            keep = min(self._first_needed(g, seq.num_computed), len(seq.tables[g]))
            table = seq.tables[g]
            for i in range(seq.dropped[g], keep):
                self._release(table[i])
                table[i] = 0
            seq.dropped[g] = max(seq.dropped[g], keep)

    def _take_state_slot(self, seq: Sequence) -> None:
        if not self.num_state_slots:
            return
        assert seq.state_slot < 0, "sequence already holds a state slot"
        if not self.free_state_slots:  # the scheduler admits at most max_running (= slots) sequences
            raise RuntimeError("no recurrent-state slot free: more running sequences than state slots")
        seq.state_slot = self.free_state_slots.pop()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (same prompt, computed KV)."""
        assert not child.block_table
        for table, dropped in zip(parent.tables, parent.dropped):
            for block in table[dropped:]:
                self.ref_count[block] += 1
        child.tables = [list(t) for t in parent.tables]
        child.dropped = list(parent.dropped)
        child.num_computed = parent.num_computed
        if parent.state_slot >= 0:
            self._take_state_slot(child)
            self.pending_state_copies.append((parent.state_slot, child.state_slot))
        self._hashed[child.seq_id] = self._hashed.get(parent.seq_id, (0, parent.lora_key))

    def prepare_append(self, seq: Sequence) -> bool:
        """Make the slot of ``seq``'s last token writable in every group: a new block, or a private copy of a
        shared one."""
        idx = (len(seq) - 1) // self.block_size
        for table in seq.tables:
            while idx >= len(table):
                if not self.free:
                    return False
                table.append(self._take_free())
            block = table[idx]
            if self.ref_count[block] > 1:
                if not self.free:
                    return False
                new = self._take_free()
                self.ref_count[block] -= 1
                self.pending_copies.append((block, new))
                table[idx] = new
        return True

    def reserve_tokens(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks so that ``seq`` can hold ``num_tokens`` tokens in every group (chunked prefill, k-step decode)."""
        need = self.blocks_for(num_tokens)
        for table in seq.tables:
            while len(table) < need:
                if not self.free:
                    return False
                table.append(self._take_free())
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the weights changed, so their K/V are stale (call it between requests)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self._hashed = {}  # each live sequence hashes again from its first block (and its adapter's salt)

    # ---- prefix cache registration -------------------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Register the full blocks whose K/V are now computed, so later prefixes can reuse them (each group's
        blocks it still holds)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        done, prev = self._hashed.get(seq.seq_id, (0, seq.lora_key))
        full = min(seq.num_computed // bs, len(seq.block_table))
        for i in range(done, full):
            chunk = seq.tokens[i * bs : (i + 1) * bs]
            prev = _chain_hash(prev, chunk if seq.mm is None else _with_images(seq, chunk, i * bs))
            for g, table in enumerate(seq.tables):
                if i < seq.dropped[g] or i >= len(table):
                    continue
                block, key = table[i], self._key(g, prev)
                if self.block_hash[block] is None and key not in self.cached and self.ref_count[block] == 1:
                    self.block_hash[block] = key
                    self.cached[key] = block
        self._hashed[seq.seq_id] = (max(done, full), prev)
