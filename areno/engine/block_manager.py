"""Paged KV-cache bookkeeping: block allocation, prefix caching by block hash, fork and copy-on-write.

The cache holds ``num_blocks`` blocks of ``block_size`` token slots. A block is shared by reference count:
- the n samples of one prompt fork from the first sample after its prefill and share all its blocks; the last,
  partly filled block is copied (copy-on-write) by whichever sample writes into it first while it is shared;
- a full block whose K/V are computed is registered under a hash chained over all tokens up to its end (and the
  content hashes of the images whose tokens it holds), so a later request with the same prefix reuses it. Freed
  blocks keep their hash and sit in an LRU free list until a new allocation evicts them.
No device memory is touched here; copies are queued in ``pending_copies`` for the model runner.

Hybrid models (``state_slots`` > 0): each sequence also holds a recurrent-state slot (``seq.state_slot``) from
allocation to free; a fork gives the child its own slot and queues the copy of the parent's state in
``pending_state_copies`` (see ``state_cache.py``).
"""

from __future__ import annotations

from collections import OrderedDict

from areno.engine.sequence import Sequence


def _chain_hash(prev: int, tokens) -> int:
    return hash((prev, tuple(tokens)))


def _with_images(seq: Sequence, tokens: list[int], start: int) -> list:
    """A block's key material: its tokens, and for a block holding image tokens the images' content hashes (the
    placeholder ids are the same for every image, so two prompts with other images never share the block)."""
    extra = seq.mm.ids_in(start, start + len(tokens))
    return tokens + [extra] if extra else tokens


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, state_slots: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one slot")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # chained hash -> block id
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

    def can_allocate(self, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_for(num_tokens) + reserve <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached full blocks of its prefix.

        At least the last token is always left to compute, since its logits give the next token.
        """
        assert not seq.block_table, "sequence already holds blocks"
        self._take_state_slot(seq)
        bs, tokens, mm = self.block_size, seq.tokens, seq.mm
        prev, hit = 0, True
        n_blocks = self.blocks_for(len(tokens))
        for i in range(n_blocks):
            chunk = tokens[i * bs : (i + 1) * bs]
            block = None
            if self.prefix_caching and hit and len(chunk) == bs and (i + 1) * bs < len(tokens):
                prev = _chain_hash(prev, chunk if mm is None else _with_images(seq, chunk, i * bs))
                block = self.cached.get(prev)
                if block is not None:
                    if self.ref_count[block] == 0:
                        del self.free[block]
                    self.ref_count[block] += 1
            if block is None:
                hit = False
                block = self._take_free()
            seq.block_table.append(block)
        cached_blocks = 0
        for block in seq.block_table:
            if self.block_hash[block] is None:
                break
            cached_blocks += 1
        seq.num_computed = seq.num_cached = seq.prefix_cached = cached_blocks * bs
        if self.prefix_caching:
            self.prefix_queries += len(tokens)
        self.prefix_hits += seq.num_cached
        last_hash = self.block_hash[seq.block_table[cached_blocks - 1]] if cached_blocks else 0
        self._hashed[seq.seq_id] = (cached_blocks, last_hash)

    def free_seq(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, "block freed twice"
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:  # nothing to keep: reuse it first
                    self.free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_computed = seq.num_cached = 0
        self._hashed.pop(seq.seq_id, None)
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1

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
        for block in parent.block_table:
            self.ref_count[block] += 1
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed
        if parent.state_slot >= 0:
            self._take_state_slot(child)
            self.pending_state_copies.append((parent.state_slot, child.state_slot))
        self._hashed[child.seq_id] = self._hashed.get(parent.seq_id, (0, 0))

    def prepare_append(self, seq: Sequence) -> bool:
        """Make the slot of ``seq``'s last token writable: a new block, or a private copy of a shared one."""
        idx = (len(seq) - 1) // self.block_size
        while idx >= len(seq.block_table):
            if not self.free:
                return False
            seq.block_table.append(self._take_free())
        block = seq.block_table[idx]
        if self.ref_count[block] > 1:
            if not self.free:
                return False
            new = self._take_free()
            self.ref_count[block] -= 1
            self.pending_copies.append((block, new))
            seq.block_table[idx] = new
        return True

    def reserve_tokens(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks so that ``seq`` can hold ``num_tokens`` tokens (chunked prefill grows into its table)."""
        while len(seq.block_table) < self.blocks_for(num_tokens):
            if not self.free:
                return False
            seq.block_table.append(self._take_free())
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the weights changed, so their K/V are stale (call it between requests)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self._hashed = {seq_id: (0, 0) for seq_id in self._hashed}

    # ---- prefix cache registration -------------------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Register the full blocks whose K/V are now computed, so later prefixes can reuse them."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        done, prev = self._hashed.get(seq.seq_id, (0, 0))
        full = min(seq.num_computed // bs, len(seq.block_table))
        for i in range(done, full):
            chunk = seq.tokens[i * bs : (i + 1) * bs]
            prev = _chain_hash(prev, chunk if seq.mm is None else _with_images(seq, chunk, i * bs))
            block = seq.block_table[i]
            if self.block_hash[block] is None and prev not in self.cached and self.ref_count[block] == 1:
                self.block_hash[block] = prev
                self.cached[prev] = block
        self._hashed[seq.seq_id] = (max(done, full), prev)
