"""Routing replay for sparse-MoE RL: the training forward uses the experts the rollout engine chose for each token.

A MoE router picks its top-k experts by comparing scores; the rollout engine (bf16, its own kernels and batch shapes)
and the trainer compute slightly different scores, so near-ties send some tokens to other experts in training than
in rollout, and the trainer's log-probs of those tokens move far more than kernel rounding would: the largest
rollout/trainer mismatch in MoE RL. With ``--routing-replay`` the engine records, per token and MoE layer, the top-k
ids it used (``EngineConfig.record_routing`` -> ``Completion.routed_experts``); rows carry them
(``Row.routed_experts``), ``pack`` lays them out per packed token (``Packed.routed_experts``, -1 where unknown: a
row's last token, which the engine never fed, and rows without a record such as agentic ones), and the trainer's
policy forward passes them to the model (``routed_experts=``). Each MoE layer then runs those experts with weights
from the current router (so the router still gets gradients); load counters count the replayed ids. The reference
model and the critic route by themselves.
"""

from __future__ import annotations

from areno.config import ConfigError
from areno.config.constants import RL_ALGOS


def routing_replay_enabled(cfg, model) -> bool:
    """Whether this run replays routing (``--routing-replay``: auto/on/off) for the policy ``model``; "on" with a
    dense policy is a ``ConfigError`` naming the flag."""
    sparse = model.is_moe
    mode = getattr(cfg, "routing_replay", "off")
    if mode == "on" and not sparse:
        raise ConfigError("--routing-replay", f"on needs a sparse-MoE policy; {cfg.ckpt!r} is a dense model (no "
                          "routed experts to replay)")
    return mode != "off" and sparse and cfg.algo in RL_ALGOS
