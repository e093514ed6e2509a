"""The ``Rollout`` protocol: what the loop, the RL steps, evaluation and the agentic rollout may call on a rollout.

Both implementations honour all of it: ``ColocatedRollout`` (colocated.py: the engine in the trainer's process, on
the trainer's own tensors) and ``RemoteRollout`` (remote.py: split mode, engines on --rollout-devices).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol


class Rollout(Protocol):
    def share(self, rows: list) -> list:
        """This rank's part of a batch (every rank calls ``rollout``/``generate`` with its share)."""

    def gather(self, obj) -> list:
        """Every rank's ``obj`` whose completions this rank holds (for the rows of the whole batch)."""

    def rollout(self, prompt_ids: list, options, upcoming: list | None = None, *,
                on_group: Callable | None = None, keys: dict | None = None) -> tuple[list, dict]:
        """Completions per prompt and the rollout's stats; ``upcoming``: the next steps' batches of prompts (a list
        of lists), sent ahead where the implementation can; ``on_group(i, completions)``: called as prompt ``i``'s
        group finishes, where the implementation sees groups finish (the others are handed over when it returns);
        ``keys`` (partial rollout): the prompts' keys ({"batch": [...], "upcoming": [[...], ...]}), and the stats
        then hold ``delivered``, the key of each group returned (cut tails of earlier batches among them)."""

    def generate(self, prompt_ids: list, options, *, on_finished: Callable | None = None) -> list:
        """Completions per prompt with the current policy (evaluation, the SDK); ``options``: one SamplingParams or
        one per prompt (an evaluation set's, each with its own seed: the training seed stream is not drawn from);
        ``on_finished(i, completions)``: called once per prompt as its group is done (``Engine.generate``'s)."""

    def sync(self) -> dict:
        """Bring the engines up to the trainer's weights (no-op when they share them); stats of the transfer."""

    def refresh(self) -> None:
        """Forget what the previous policy cached (prefix K/V) if the weights moved."""

    def policy_changed(self) -> None:
        """The trainer's weights were replaced outright (a resume): the next sync sends every tensor."""

    def token_sampler(self) -> AbstractContextManager[Callable]:
        """For an agentic rollout: a context in which a factory gives clients with ``await sample(prompt_ids,
        options, key) -> dict`` (ids, logprobs, finish_reason, stop_text, prefix_cached) and ``await aclose()``."""

    def rng_state(self):
        """The sampling RNG's state (checkpoints)."""

    def set_rng_state(self, state) -> None: ...

    def in_flight_count(self) -> int:
        """How many of the next steps' rollouts are already on their way (async split mode; after a resume, those
        its checkpoint held)."""

    def in_flight_state(self) -> dict | None:
        """What a checkpoint must hold of a rollout already sampled for the next step (None: nothing)."""

    def restore_in_flight(self, state: dict | None) -> None:
        """Take a checkpoint's ``in_flight_state`` back (a resume)."""

    def drop_rollout_state(self) -> None:
        """Free the engine's rollout state (KV cache, graphs) until the next rollout (--drop-rollout-state)."""

    def close(self) -> None: ...
