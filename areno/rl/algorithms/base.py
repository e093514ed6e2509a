"""What an algorithm is to the loop: ``Algorithm`` (its step, its capabilities) and ``StepContext`` (what a step uses).

A step is ``step(ctx, batch, upcoming=None) -> metrics``: ``batch`` is this step's ``Prompt``s (areno.training.data),
``upcoming`` the next step's (only for an algorithm with ``needs_reward``, in async split mode). It reaches the
trainer, the rollout and the reference through ``ctx``, never through the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    """One training algorithm: its step and the capabilities the set-up and the loop read."""

    step: Callable  # (ctx: StepContext, batch: list[Prompt], upcoming=None) -> dict of metrics
    needs_reward: bool = False  # learns from scored rollouts: an engine, --n-samples, --reward-fn-path or --agent-fn
    needs_ref: bool = False  # a reference model whatever --kl-coef (with --kl-coef > 0 every algorithm gets one)
    uses_critic: bool = False  # a value model and its own trainer (ctx.critic_trainer)
    responses: tuple[str, ...] = ()  # the row fields tokenised as responses (Prompt.responses)
    prompt_optional: bool = False  # a row may have no prompt (DPO pairs)


@dataclass
class StepContext:
    """What a step may use. ``rollout(batch, upcoming) -> (rows, stats)`` samples and scores (RL algorithms);
    ``dump(rows, stats)`` writes --rollout-dump-dir; ``media_of(prompt)`` gives a prompt's images."""

    cfg: object  # the TrainConfig
    trainer: object  # the policy's PolicyTrainer
    eos_id: int | None
    media_of: Callable
    ref: object = None  # the frozen reference model (needs_ref or --kl-coef > 0)
    critic_trainer: object = None  # the value model's PolicyTrainer (uses_critic)
    rollout: Callable | None = None
    dump: Callable | None = None
    drop_rollout_state: Callable | None = None  # --drop-rollout-state: free the engine's rollout state after a step
    dp_group: object = None
    dp_size: int = 1
    step_index: int = 0  # steps done before this one


def updates_per_step(cfg, units: int, dp_size: int) -> int:
    """Optimizer updates one train() pass makes over ``units`` rows (pairs for DPO): the decay schedules count
    updates, so their length is steps x this (x epochs)."""
    return max(1, -(-units // (cfg.mini_bs * cfg.gradient_accumulation_steps * dp_size)))


def normalise(stats: dict) -> dict:
    """Turn summed stats into means: *_sum over tokens (or seqs / pairs), loss over updates."""
    out = {}
    tokens = stats.get("tokens") or stats.get("seqs") or stats.get("pairs") or 1.0
    for k, v in stats.items():
        if k.endswith("_sum"):
            denom = stats.get("pairs", tokens) if k in ("reward_margin_sum", "accuracy_sum") else tokens
            out[k[:-4]] = v / max(denom, 1e-9)
        elif k == "loss":
            out[k] = v / max(1, stats.get("num_updates", 1))
        elif k not in ("tokens", "seqs", "pairs"):
            out[k] = v
    return out
