"""Advantages: GRPO/GSPO group normalisation and PPO's GAE, plus the zero-variance group count."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6):
    """``rewards [G * n]`` ordered group by group -> (advantages [G * n], zero_variance_mask [G]).

    A_i = r_i - mean(group), divided by the group's (unbiased) std when ``std_normalize``. A group whose rewards are
    all equal has zero advantages (and is flagged, so the loop can count or filter it).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    adv = r - mean
    zero_var = (r.max(dim=1).values - r.min(dim=1).values).abs() <= 1e-12
    if std_normalize and group_size > 1:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    adv = torch.where(zero_var[:, None], torch.zeros_like(adv), adv)
    return adv.view(-1), zero_var


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation over padded ``[B, T]`` response tokens.

    ``rewards``: per-token rewards (usually the scalar reward on the last response token, minus any KL penalty);
    ``values``: critic values V(s_t); ``mask``: 1 for response tokens. The value after the last token is 0.
    Returns (advantages, returns), both ``[B, T]`` and zero outside the mask.
    """
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        last = last * m
        adv[:, t] = last
        next_value = torch.where(m > 0, values[:, t], next_value)  # padding does not move the recursion
    returns = (adv + values) * mask
    return adv * mask, returns
