"""GRPO and GSPO: n samples per prompt, group-normalised advantages, then clipped policy-gradient updates.

``policy_step`` is the RL step every policy-gradient algorithm shares (PPO adds its critic through its hooks):
rollout and rewards -> group advantages (zero-variance groups filtered with --filter-zero-variance-groups) ->
--rollout-dump-dir -> the trainer's log-probs of the rollout tokens (folded into the update when it is the only
one) and the reference's -> the updates. GSPO is this step with its sequence-level loss.
"""

from __future__ import annotations

import time

import torch

from areno.distributed.collectives import gather_objects
from areno.rl.advantages import group_advantages
from areno.rl.algorithms.base import Algorithm, normalise, updates_per_step
from areno.rl.algorithms.loss_fns import correction_of, grpo_loss_fn, gspo_loss_fn, inline_proximal
from areno.rl.corrections import drop_stale, mismatch_metrics, mismatch_sums, version_lag


def scored_rows(ctx, batch, upcoming=None, *, filter_zero_variance: bool = True):
    """This step's rollout rows with their group advantages (and the dump written), and the metrics so far."""
    cfg = ctx.cfg
    rows, m = ctx.rollout(batch, upcoming)
    t_rows = time.perf_counter()
    # rows of one sample (an agent's forks) share its reward and advantage; groups are n samples of a prompt
    sample = [r.extras.pop("sample", i) for i, r in enumerate(rows)]
    if "sample_rewards" in m:  # agentic: a sample can end with no row (its agent failed before sampling)
        rewards = torch.tensor(m.pop("sample_rewards"), dtype=torch.float32)
    else:
        rewards = torch.tensor([r.reward for r in rows], dtype=torch.float32)
    adv, zero_var = group_advantages(rewards, cfg.n_samples, std_normalize=cfg.advantage_std_norm)
    m.update(reward_mean=rewards.mean().item(), reward_std=rewards.std().item() if len(rewards) > 1 else 0.0,
             reward_min=rewards.min().item(), reward_max=rewards.max().item(),
             zero_variance_groups=int(zero_var.sum()), groups=len(zero_var))
    advantages = adv.tolist()
    for r, s in zip(rows, sample):
        r.advantage = advantages[s]
        r.meta.update(sample=s, advantage=r.advantage)
    if cfg.filter_zero_variance_groups and filter_zero_variance:
        zero = zero_var.tolist()
        rows = [r for r, s in zip(rows, sample) if not zero[s // cfg.n_samples]]
    if ctx.dump is not None:
        ctx.dump(rows, m)
    if cfg.split:  # --max-staleness K, per sample (after the group advantages: the others keep theirs)
        rows, m["stale_dropped"] = drop_stale(rows, ctx.step_index, m.get("policy_version"), cfg.max_staleness)
    rows = [r for r in rows if r.response_ids and (r.loss_mask is None or any(r.loss_mask))]
    return rows, m, t_rows


def reference_logprobs(ctx, rows, m, *, inline: bool, correction=None) -> None:
    """The trainer's view of the rollout tokens (logprob_diff, the mismatch metrics and the weights of
    ``correction``, an areno.rl.corrections.Correction, as each row's ``tis`` extras) unless the update gives it
    inline, and the reference's log-probs (KL) when there is a reference."""
    cfg = ctx.cfg
    if not inline:
        prox = ctx.trainer.compute_logprobs(rows, cfg.mini_bs)  # the trainer's view of the rollout tokens
        diffs = [abs(a - b) for r, p in zip(rows, prox) for a, b in zip(p, r.scored(r.rollout_logprobs))]
        m["logprob_diff"] = sum(diffs) / max(1, len(diffs))
        m["logprob_diff_max"] = max(diffs, default=0.0)
        totals, top = {}, 0.0
        for r, p in zip(rows, prox):  # one row is one sequence
            log_ratio = torch.tensor(p, dtype=torch.float64) - torch.tensor(r.scored(r.rollout_logprobs),
                                                                             dtype=torch.float64)
            mask = torch.ones_like(log_ratio)
            weights = correction.weights(log_ratio, mask) if correction is not None else None
            if weights is not None:
                r.extras["tis"] = r.spread(weights.tolist())
            sums = mismatch_sums(log_ratio, mask, weights)
            top = max(top, float(sums.pop("is_ratio_max")))
            totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
        if totals:
            m.update(mismatch_metrics(totals, top))
    if ctx.ref is not None:
        for r, p in zip(rows, ctx.trainer.compute_logprobs(rows, cfg.mini_bs, model=ctx.ref)):
            r.extras["ref"] = r.spread(p)


def makes_one_update(ctx, rows) -> bool:
    """Whether this step makes exactly one optimizer update (so its forward sees the rollout-time weights)."""
    return ctx.cfg.ppo_epochs == 1 and updates_per_step(ctx.cfg, len(rows), ctx.dp_size) == 1


def policy_step(ctx, batch, upcoming=None, *, loss_fn, filter_zero_variance=True, single_update=True, values=None,
                critic_update=None, train_policy=True) -> dict:
    """One RL step with ``loss_fn`` (a LossFn) and the run's --off-policy-correction; ``values(ctx, rows) ->
    metrics`` runs before the update and ``critic_update(ctx, rows) -> metrics`` after it (PPO)."""
    cfg = ctx.cfg
    rows, m, t_rows = scored_rows(ctx, batch, upcoming, filter_zero_variance=filter_zero_variance)
    if not rows:
        m["skipped"] = 1
        return m
    m.update(version_lag(rows, ctx.step_index, m.get("policy_version")))
    correction = correction_of(cfg)
    t0 = time.perf_counter()
    m["pack_s"] = m.get("pack_s", 0.0) + t0 - t_rows  # rows, advantages, filters: host time before the update
    # One optimizer update per rollout batch: the update's own forward (detached) is the trainer's view of the
    # rollout tokens, so the separate no-grad pass is skipped (same weights, same kernels, same numbers).
    inline = single_update and makes_one_update(ctx, rows)
    reference_logprobs(ctx, rows, m, inline=inline, correction=correction)
    m["logprob_s"] = time.perf_counter() - t0
    if values is not None:
        m.update(values(ctx, rows))
    if inline:
        loss_fn = inline_proximal(loss_fn, correction)
    t1 = time.perf_counter()
    if train_policy:
        s = ctx.trainer.train(rows, loss_fn, cfg.mini_bs, cfg.gradient_accumulation_steps, epochs=cfg.ppo_epochs,
                              entropy=cfg.entropy_coef > 0, shuffle_seed=cfg.seed)
        if inline:
            m["logprob_diff"] = s.pop("logprob_diff_total") / max(1.0, s.pop("logprob_diff_count"))
            top = float(loss_fn.fn.max_diff) if loss_fn.fn.max_diff is not None else 0.0
            m["logprob_diff_max"] = max(gather_objects(top, ctx.dp_group))
            ratio = float(loss_fn.fn.max_ratio) if loss_fn.fn.max_ratio is not None else 0.0
            totals = {k: s.pop(k) for k in ("is_ratio_total", "masked_total", "mismatch_kl_total", "mismatch_tokens")}
            m.update(mismatch_metrics(totals, max(gather_objects(ratio, ctx.dp_group))))
        m.update(normalise(s))
    if critic_update is not None:
        m.update(critic_update(ctx, rows))
    m["train_s"] = time.perf_counter() - t1
    n_train = sum(len(r) for r in rows) * (cfg.ppo_epochs + (not inline))
    m["train_tok_s"] = n_train / max(1e-9, m["train_s"] + m["logprob_s"])
    if cfg.drop_rollout_state and ctx.drop_rollout_state is not None:
        ctx.drop_rollout_state()
    return m


def grpo_step(ctx, batch, upcoming=None) -> dict:
    return policy_step(ctx, batch, upcoming, loss_fn=grpo_loss_fn(ctx.cfg))


def gspo_step(ctx, batch, upcoming=None) -> dict:
    return policy_step(ctx, batch, upcoming, loss_fn=gspo_loss_fn(ctx.cfg))


GRPO = Algorithm(grpo_step, needs_reward=True)
GSPO = Algorithm(gspo_step, needs_reward=True)
