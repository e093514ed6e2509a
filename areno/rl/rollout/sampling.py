"""The rollout's sampling settings from a TrainConfig: the one place the RL side builds them (rollout, evaluation and
the agent endpoint alike)."""

from __future__ import annotations


def sampling_adjustments(cfg) -> dict:
    """The rollout's --min-p and penalties as SamplingOptions fields (rollout and agentic sampling alike)."""
    return {"min_p": cfg.min_p, "repetition_penalty": cfg.repetition_penalty,
            "presence_penalty": cfg.presence_penalty, "frequency_penalty": cfg.frequency_penalty}


def sampling_options(cfg, n=None, greedy=False):
    """The engine's options for a rollout (``n``: default --n-samples; ``greedy``: temperature 0, evaluation)."""
    from areno.engine.sequence import SamplingOptions

    return SamplingOptions(
        temperature=0.0 if greedy else cfg.temperature, top_p=cfg.top_p, top_k=max(0, cfg.top_k),
        max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens, stop=cfg.stop or [],
        n=n or cfg.n_samples, **sampling_adjustments(cfg),
    )
