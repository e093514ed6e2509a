"""A sequence being generated: its tokens, log-probs, sampling settings, KV blocks and timings."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

FP32_MAX = 3.4028234663852886e38


@dataclass
class SamplingOptions:
    """Per-sequence generation settings (the engine's view of SamplingParams)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    top_logprobs: int = 0  # also return the k most likely tokens' log-probs at each step
    # logit adjustments before temperature (vLLM's semantics; areno.kernels.penalties), then min-p after it
    repetition_penalty: float = 1.0  # > 0, 1 = off: logits of prompt/output tokens divided (> 0) or multiplied
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence of a token in the output
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p * the most likely one
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    grammar: dict | None = None  # structured output spec (areno.engine.grammar): {"type": "json_object"}, ...

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError("min_new_tokens must be between 0 and max_new_tokens")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        self.stop = [s for s in ([self.stop] if isinstance(self.stop, str) else list(self.stop or [])) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not 0 < self.repetition_penalty <= FP32_MAX:  # applied in fp32: an overflow would make inf * 0
            raise ValueError(f"repetition_penalty must be > 0 (and a finite fp32), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()}
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        # whether a step may have to adjust this sequence's logits (the engine's hot path reads only this flag)
        self.adjusts_logits = bool(self.penalized or self.min_p > 0 or self.logit_bias or self.min_new_tokens)
        if self.grammar is not None:
            from areno.engine.grammar import normalize

            self.grammar = normalize(self.grammar)

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the sequence's token counts (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    """One sample. Its KV covers ``tokens[:num_computed]``; ``block_table`` maps token i to block i // block_size."""

    def __init__(self, prompt_ids: list[int], options: SamplingOptions, *, request_id=None, sample_index=0, seed=0):
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
        self.block_table: list[int] = []
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.num_cached = 0  # of those, how many came from the prefix cache
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
