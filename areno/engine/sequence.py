"""A sequence being generated: its tokens, log-probs, sampling settings, KV blocks and timings."""

from __future__ import annotations

import enum
import itertools
import time

from areno.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    """One sample. Its KV covers ``tokens[:num_computed]``; ``block_table`` maps token i to block i // block_size.

    A model with sliding-window layers has several KV-cache groups (``areno.engine.kv_cache.kv_groups``): ``tables``
    holds one block table per group (``block_table`` is group 0's), and ``dropped[g]`` counts the leading entries of
    group g's table that no longer hold a block (left of its window; they read 0, a block the kernels may touch but
    mask out)."""

    def __init__(self, prompt_ids: list[int], options: SamplingParams, *, request_id=None, sample_index=0, seed=0):
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else self.seq_id
        self.sample_index = sample_index
        self.options = options
        self.seed = seed
        self.prompt_len = len(prompt_ids)
        self.tokens: list[int] = list(prompt_ids)
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.tables: list[list[int]] = [[]]  # one block table per KV-cache group (set by the BlockManager)
        self.dropped: list[int] = [0]  # per group: leading table entries released (left of the group's window)
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.num_cached = 0  # of those, how many came from the prefix cache
        self.lora_slot = -1  # LoRA serving: its adapter's slot (areno.engine.lora_slots), -1: the base model
        self.lora_key = 0  # that adapter load's prefix-cache salt (0: the base model)
        self.state_slot = -1  # hybrid models: the slot of its recurrent state (areno.engine.state_cache), -1: none
        self.routing: list = []  # routing capture: (first position, int16 [n, num_moe_layers, k] expert ids) pieces
        self.prefix_cached = 0  # prompt tokens the prefix cache served at the last allocation (kept after freeing)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_text: str | None = None  # the stop string that ended it, if any
        self.text = ""  # the output text cut before the stop string (set when one ends the sequence)
        self.fork_parent: Sequence | None = None  # n > 1: siblings wait for the first sample's prefill
        self.grammar = None  # a grammar.Matcher when options.grammar is set (the engine attaches it)
        self.mm = None  # images.PromptImages of a prompt with images (the engine attaches it; its samples share it)
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def block_table(self) -> list[int]:
        return self.tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.tables[0] = table

    def __len__(self):
        return len(self.tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int, logprob: float):
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.tokens.append(int(token))
        self.logprobs.append(float(logprob))

    def extend(self, tokens: list[int], logprobs: list[float]):
        if tokens and self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)

    def finish(self, reason: str):
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

    def timings(self) -> dict:
        end = self.finish_time or time.perf_counter()
        ttft = (self.first_token_time - self.arrival) if self.first_token_time else None
        return {"queued_s": None, "ttft_s": ttft, "total_s": end - self.arrival}
