"""The RL rollout: the ``Rollout`` protocol (protocol.py), its colocated and remote implementations, the policy
stream to remote engines (policy_sync.py) and a step's scored rows (collect.py, finished_groups.py); the sampling
settings are ``config.SamplingParams.from_train_config``. ``build_rollout`` picks the implementation of a
TrainConfig."""

from __future__ import annotations

from areno.rl.rollout.protocol import Rollout


def build_rollout(cfg, model, tokenizer, trainer, groups, *, step_index) -> Rollout:
    """Split mode (--rollout-devices): a ``RemoteRollout`` over ``groups.layout``; else a ``ColocatedRollout`` on
    ``model``. ``trainer``: the policy's (its optimizer's step count is the policy version); ``step_index()``: the
    loop's step count."""
    if cfg.split:
        from areno.rl.rollout.remote import RemoteRollout

        return RemoteRollout(model, trainer.optimizer, cfg, groups.layout, step_index=step_index)
    from areno.rl.rollout.colocated import ColocatedRollout

    return ColocatedRollout(model, tokenizer, trainer.optimizer, cfg, dp_rank=groups.dp_rank, dp_size=groups.dp_size,
                            dp_group=groups.dp_group, record_routing=trainer.routing_replay)


__all__ = ["Rollout", "build_rollout"]
