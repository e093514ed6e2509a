"""PPO: the shared policy-gradient step (areno.rl.algorithms.grpo) with a critic: GAE advantages from the value model
before the update (whitened over the batch's response tokens), dual clip, and a clipped value-loss update after it;
the policy waits --critic-warmup-steps steps while the critic learns."""

from __future__ import annotations

import torch

from areno.rl.advantages import gae
from areno.rl.algorithms.base import Algorithm, normalise
from areno.rl.algorithms.grpo import policy_step
from areno.rl.algorithms.loss_fns import grpo_loss_fn
from areno.rl.losses import value_loss


def values(ctx, rows) -> dict:
    """Per-token advantages, old values and returns of ``rows`` from the critic (GAE, whitened)."""
    cfg = ctx.cfg
    with torch.no_grad():
        v_rows = ctx.critic_trainer.model.response_values(rows, cfg.mini_bs)
    R = max(len(r.response_ids) for r in rows)
    pad = lambda xs: xs + [0.0] * (R - len(xs))  # noqa: E731
    v = torch.tensor([pad(x) for x in v_rows])
    mask = torch.tensor([[1.0] * len(r.response_ids) + [0.0] * (R - len(r.response_ids)) for r in rows])
    rew = torch.zeros_like(v)
    for i, r in enumerate(rows):
        rew[i, len(r.response_ids) - 1] = r.reward
    adv, ret = gae(rew, v, mask, gamma=cfg.gamma, lam=cfg.gae_lambda)
    flat = adv[mask > 0]
    mean, std = flat.mean(), flat.std() if flat.numel() > 1 else torch.tensor(1.0)
    adv = (adv - mean) / (std + 1e-8) * mask  # whitened over the batch's response tokens
    for i, r in enumerate(rows):
        n = len(r.response_ids)
        r.token_advantages = adv[i, :n].tolist()
        r.extras["old_values"] = v[i, :n].tolist()
        r.extras["returns"] = ret[i, :n].tolist()
    return {"value_mean": float(v[mask > 0].mean()), "return_mean": float(ret[mask > 0].mean())}


def critic_update(ctx, rows) -> dict:
    cfg = ctx.cfg

    def fn(out, packed, norms):
        return value_loss(out.values, packed.tok["old_values"], packed.tok["returns"], packed.mask,
                          clip=cfg.value_clip, norm=norms.num_tokens)

    s = ctx.critic_trainer.train(rows, fn, cfg.mini_bs, cfg.gradient_accumulation_steps, epochs=cfg.ppo_epochs)
    return {"critic_" + k: v for k, v in normalise(s).items()}


def step(ctx, batch, upcoming=None) -> dict:
    cfg = ctx.cfg
    return policy_step(ctx, batch, upcoming, loss_fn=grpo_loss_fn(cfg, dual_clip=cfg.dual_clip),
                       filter_zero_variance=False, single_update=False, values=values, critic_update=critic_update,
                       train_policy=ctx.step_index >= cfg.critic_warmup_steps)


STEP = Algorithm(step, needs_reward=True, uses_critic=True)
