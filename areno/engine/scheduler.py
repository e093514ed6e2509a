"""Continuous batching: which sequences run in the next forward step, and which tokens of each.

A step either decodes one token for every running sequence (the CUDA-graph path), or, when prompts are waiting or
mid-prefill, mixes those decodes with prefill chunks under a token budget (chunked prefill). Waiting requests are
admitted as soon as a slot and blocks allow, so short requests start while long ones decode. When blocks run out,
the youngest running sequence is preempted and later recomputed (its prefix blocks usually come back from the prefix
cache); the oldest always makes progress, so there is no deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from areno.engine.block_manager import BlockManager
from areno.engine.sequence import Sequence, Status


@dataclass
class Chunk:
    seq: Sequence
    start: int  # first token to compute
    end: int  # one past the last; the step samples the next token when end == len(seq)
    samples: bool = field(init=False)

    def __post_init__(self):
        self.samples = self.end == len(self.seq.tokens)


@dataclass
class Step:
    chunks: list[Chunk] = field(default_factory=list)  # decodes are chunks of one token
    is_decode: bool = False  # every chunk is a one-token decode of a fully computed sequence
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_running: int, max_batched_tokens: int, max_model_len: int):
        if max_running < 1 or max_batched_tokens < 1:
            raise ValueError("max_running and max_batched_tokens must be positive")
        self.blocks = blocks
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------------------------------
    def add(self, group: list[Sequence]) -> None:
        """A request's samples; samples 1..n-1 fork from sample 0 once its prompt is computed."""
        self.check(group)
        head = group[0]
        head.children = group[1:]
        for child in head.children:
            child.fork_parent = head
        self.waiting.append(head)

    def check(self, group: list[Sequence]) -> None:
        """A ValueError if the request can never run: too many samples, past the context or the KV cache."""
        head = group[0]
        if len(group) > self.max_running:
            raise ValueError(f"n={len(group)} samples exceed the cap of {self.max_running} running sequences")
        total = len(head) + head.options.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(head)} tokens) + max_new_tokens exceeds the context ({self.max_model_len})")
        if self.blocks.peak_blocks(len(head), total, self.max_batched_tokens) > self.blocks.num_blocks:
            raise ValueError(
                f"a sequence of {total} tokens needs more KV blocks than the cache holds ({self.blocks.num_blocks})"
            )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free_seq(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        for child in getattr(seq, "children", []):  # unforked siblings go with their head
            if not child.is_finished:
                child.finish("abort")
        seq.children = []
        if not seq.is_finished:
            seq.finish("abort")

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free_seq(seq)

    # ---- one step ------------------------------------------------------------------------------------------
    def can_admit(self) -> bool:
        """Whether a waiting request could join the batch at the next schedule: one waits and its group (the prompt's
        n samples) fits under max_running (KV blocks aside). While none can, decode steps may be chained as if
        nothing waited: an evaluation's queue of thousands behind a full batch costs nothing but the few steps a
        finished sequence's slot stays empty."""
        return bool(self.waiting) and self._occupied() + self._group_size(self.waiting[0]) <= self.max_running

    def _group_size(self, seq: Sequence) -> int:
        return 1 + len(getattr(seq, "children", []))

    def _occupied(self) -> int:
        """The running sequences with the unforked siblings of the heads among them: each will hold a slot (and a
        hybrid's state slot) once its head's prompt is computed."""
        return sum(self._group_size(s) for s in self.running)

    def _preempt(self, seq: Sequence, step: Step) -> None:
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        step.preempted.append(seq)

    def _grow(self, seq: Sequence, end: int, step: Step) -> bool:
        """Blocks for ``seq``'s next prefill chunk (up to ``end``) in its sliding-window groups. When none are free
        and nothing else runs this step, the youngest sequences are preempted (``seq`` last), so the oldest always
        progresses; else ``seq`` waits for the next step."""
        while not self.blocks.reserve_tokens(seq, end):
            if step.chunks:
                return False
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def schedule(self, admit: bool = True) -> Step:
        """The next step; ``admit=False`` leaves waiting requests waiting (the engine holds them for one multi-step
        decode group at most)."""
        step = Step()
        # 1. every computed running sequence decodes one token; make room, preempting the youngest if needed
        decodes = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_computed < len(seq) - 1:
                continue  # preempted just now, or still in prefill
            while not self.blocks.prepare_append(seq):
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                decodes.append(seq)
        step.chunks = [Chunk(s, len(s) - 1, len(s)) for s in decodes]
        budget = self.max_batched_tokens - len(decodes)
        # 2. sequences mid-prefill continue (sliding-window groups take each chunk's blocks now)
        for seq in list(self.running) if self.blocks.sliding else self.running:  # _grow may preempt
            if budget <= 0:
                break
            if seq.status is Status.RUNNING and seq.num_computed < len(seq) - 1:
                end = min(len(seq), seq.num_computed + budget)
                if self.blocks.sliding and not self._grow(seq, end, step):
                    break
                step.chunks.append(Chunk(seq, seq.num_computed, end))
                budget -= end - seq.num_computed
        # 3. admit waiting requests while a slot, blocks and budget allow
        occupied = self._occupied()
        while admit and self.waiting and budget > 0 and not step.preempted:
            seq = self.waiting[0]
            if occupied + self._group_size(seq) > self.max_running:
                break
            # keep one free block per running sequence so admitted work does not immediately preempt decodes
            if not self.blocks.can_allocate(len(seq), reserve=len(self.running), chunk=budget):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            occupied += self._group_size(seq)
            start = seq.num_computed
            if start >= len(seq):  # fully cached cannot happen (the last token is always recomputed)
                start = len(seq) - 1
            end = min(len(seq), start + budget)
            if self.blocks.sliding:  # can_allocate counted these blocks
                assert self.blocks.reserve_tokens(seq, end)
            step.chunks.append(Chunk(seq, start, end))
            budget -= end - start
        # a head whose last prefill chunk stopped one token short "decodes" its last prompt token, and samples its
        # unforked siblings too: more rows than sequences, so not the one-row-per-sequence decode path
        step.is_decode = (bool(decodes) and len(step.chunks) == len(decodes)
                          and not any(getattr(s, "children", None) for s in decodes))
        return step

    def after_decode(self, seq: Sequence) -> None:
        """After a multi-step decode appended tokens: every token but the newest has its K/V in the cache."""
        seq.num_computed = len(seq) - 1
        self.blocks.commit(seq)
        if self.blocks.sliding:
            self.blocks.trim(seq)

    def after_step(self, step: Step) -> list[Sequence]:
        """Advance computed counts and fork siblings whose head finished its prompt; returns the forked ones."""
        forked = []
        bs = self.blocks.block_size
        for chunk in step.chunks:
            seq = chunk.seq
            seq.num_computed = chunk.end
            if chunk.end - chunk.start > 1 or chunk.end % bs == 0:  # a decode fills a block only every bs tokens
                self.blocks.commit(seq)
            if self.blocks.sliding:  # after the commit: a dropped block keeps its hash
                self.blocks.trim(seq)
            if chunk.samples:
                for child in getattr(seq, "children", []):
                    if child.is_finished:
                        continue
                    self.blocks.fork(seq, child)
                    child.status = Status.RUNNING
                    child.fork_parent = None
                    self.running.append(child)
                    forked.append(child)
                seq.children = []
        return forked
