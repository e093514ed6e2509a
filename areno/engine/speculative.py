"""Exact speculative sampling: verify a draft's proposed tokens against the target model's logits (rejection sampling).

One verify step per sequence b: the target's logits at K_b + 1 positions (after the prompt and after each of the
K_b draft tokens d_0..d_{K_b-1}) and the draft's distributions q_0..q_{K_b-1} that proposed them. Each position's
target distribution p_i is the one the engine's plain sampling would draw from there: logit_bias and the min_tokens
ban (``min_left`` less the i draft tokens before it), the repetition/presence/frequency penalties with the token
counts of the sequence plus d_0..d_{i-1} (``areno.kernels.penalties``, token by token), then temperature, min-p,
top-k, top-p (``areno.kernels.sampler.sampling_probs``). Then, in order:

    accept d_i  with probability min(1, p_i(d_i) / q_i(d_i))       (u_i * q_i(d_i) < p_i(d_i), u_i ~ U(0, 1))
    first rejection at i:  emit x ~ max(0, p_i - q_i) / sum(...)   (p_i if the residual is empty) and stop
    all K_b accepted:      emit the bonus token x ~ p_{K_b}         (exactly the engine's ``sample`` there)

so every emitted token is distributed as the target's plain sampling given the tokens before it. A greedy row
(temperature <= 0) has a one-hot p_i: the emitted tokens are the target's argmax chain, and the accepted prefix is
the draft's agreement with it. Draft tokens outside q's support are accepted where p > 0 (they are never proposed
by an exact draft; the residual still covers p there).

Randomness is the engine's: Philox keyed by the sequence's seed (``Sequence.seed``), counter the sequence index of
the token the position emits (the offset plain sampling uses there: ``len(seq)`` for the first). The bonus token
draws the very noise plain sampling would; the acceptance uniforms and the residual draws use their own streams
(the offset plus ``ACCEPT_STREAM`` / ``RESIDUAL_STREAM``, above any position), so nothing is reused.

Log-probs are the engine's: the target's log-softmax of the adjusted logits at the row's temperature (T <= 0 counts
as T = 1), before min-p/top-k/top-p (see ``areno.kernels.sampler``). The accepted tokens are counted into the
penalised rows' token-state slots, as ``LogitAdjuster.record`` does for plain steps.
Not covered yet: grammar token masks (guided decoding) and stop tokens inside the accepted run (the caller's stop
check truncates the emitted tokens as it does a multi-step decode's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areno.kernels.penalties import apply_logit_bias, apply_penalties, record_tokens
from areno.kernels.sampler import philox_bits, sample, sampling_probs

ACCEPT_STREAM = 1 << 40  # offset added for the acceptance uniforms
RESIDUAL_STREAM = 2 << 40  # offset added for the residual draws


@dataclass
class Verified:
    """A verify step's result: ``tokens`` int64 ``[B, K + 1]`` (row b emits its first ``emitted[b]`` entries, the
    rest is -1), ``logprobs`` fp32 ``[B, K + 1]`` (the target's, as the engine reports them; 0 past ``emitted``),
    ``accepted`` int64 ``[B]`` (draft tokens accepted, ``emitted - 1``)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    accepted: torch.Tensor

    @property
    def emitted(self) -> torch.Tensor:
        return self.accepted + 1

    def lists(self) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's emitted tokens and log-probs as Python lists."""
        n = self.emitted.tolist()
        return ([t[:k] for t, k in zip(self.tokens.tolist(), n)], [lp[:k] for lp, k in zip(self.logprobs.tolist(), n)])


def _rows(value, B, dtype, device, name):
    if value is None:
        return None
    t = torch.as_tensor(value, dtype=dtype, device=device).reshape(-1)
    if t.numel() not in (1, B):
        raise ValueError(f"verify_draft: {name} must be a scalar or have one value per sequence ({B}), got "
                         f"{tuple(t.shape)}")  # fmt: skip
    return t.expand(B).contiguous()


def _adjust(logits, draft_tokens, adjust, token_state):
    """The engine's logit adjustments at every position, in place on ``logits [B, K1, V]`` (fp32): position i
    sees ``min_left - i`` and the token counts plus draft tokens 0..i-1."""
    B, K1, V = logits.shape
    flat = logits.view(B * K1, V)
    steps = torch.arange(K1, device=logits.device)
    if adjust["sp_ids"].shape[1]:
        left = (adjust["min_left"].to(torch.int64)[:, None] - steps[None, :]).clamp(min=0).reshape(-1)
        apply_logit_bias(flat, *(adjust[n].repeat_interleave(K1, 0, output_size=B * K1)
                                 for n in ("sp_ids", "sp_bias", "sp_ban")), left)  # fmt: skip
    if "pen_slot" in adjust:
        slots = adjust["pen_slot"].to(torch.int64)
        on = slots >= 0
        state = token_state[slots.clamp(min=0)][:, None, :].repeat(1, K1, 1)  # [B, K1, V]
        if K1 > 1:  # counts of the draft tokens before each position
            drafted = torch.zeros(B, K1 - 1, V, dtype=torch.int32, device=logits.device)
            drafted.scatter_(2, draft_tokens[:, :, None], 1)
            state[:, 1:] += drafted.cumsum(dim=1, dtype=torch.int32)
        rows = torch.where(on[:, None], torch.arange(B * K1, device=logits.device).view(B, K1), -1).reshape(-1)
        rep, pres, freq = (adjust[n].repeat_interleave(K1, 0, output_size=B * K1) for n in ("rep", "pres", "freq"))
        apply_penalties(flat, rows, state.view(B * K1, V), rep, pres, freq)


def residual_probs(p, q):
    """The normalised residual ``max(0, p - q)`` along the last dim (``p`` where it is empty: p <= q everywhere)."""
    r = (p - q).clamp(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def _accepted(p, draft, draft_probs, live, seeds, offsets):
    """Per row, the leading run of accepted proposals: u_i * q_i(d_i) < p_i(d_i), u_i on the accept stream."""
    B, K = draft.shape
    if not K:
        return torch.zeros(B, dtype=torch.int64, device=p.device)
    u_off = (offsets[:, None] + torch.arange(K, device=p.device)[None, :] + ACCEPT_STREAM).reshape(-1)
    u = (philox_bits(seeds.repeat_interleave(K, output_size=B * K), u_off, 1)[:, 0].double() + 0.5) * 2.0**-32
    pd = p[:, :K].gather(2, draft[:, :, None])[:, :, 0].double()
    qd = draft_probs.gather(2, draft[:, :, None])[:, :, 0].double()
    ok = (u.view(B, K) * qd < pd) & live
    return ok.long().cumprod(dim=1).sum(dim=1)


def _last_token(z, p, draft_probs, n_acc, num_draft, temperature, seeds, offsets, top_k, top_p, min_p):
    """The last emitted token of each row, one ``sample`` call: the residual draw at the first rejection (temperature
    1, no filters, the residual stream), or the bonus draw after all K_b acceptances (the plain sampling there)."""
    B, K1, _ = z.shape
    rows = torch.arange(B, device=z.device)
    bonus = n_acc == num_draft
    at = p[rows, n_acc]
    if K1 > 1:
        res = torch.log(residual_probs(at, draft_probs[rows, n_acc.clamp(max=K1 - 2)].float()))
    else:
        res = torch.log(at)  # K = 0: every row draws its bonus token
    one = torch.ones_like(temperature)
    last, _ = sample(torch.where(bonus[:, None], z[rows, n_acc], res), temperature=torch.where(bonus, temperature, one),
                     seeds=seeds, offsets=offsets + n_acc + torch.where(bonus, 0, RESIDUAL_STREAM),
                     top_k=None if top_k is None else torch.where(bonus, top_k, 0),
                     top_p=None if top_p is None else torch.where(bonus, top_p, one),
                     min_p=None if min_p is None else torch.where(bonus, min_p.to(one), 0 * one))  # fmt: skip
    return last


def verify_draft(logits, draft_tokens, draft_probs, num_draft, *, temperature, seeds, offsets, top_k=None,
                 top_p=None, adjust=None, token_state=None, check: bool = True) -> Verified:  # fmt: skip
    """Exact speculative sampling of a batch (see the module docstring).

    ``logits [B, K+1, V]``: the target's logits (any float dtype; not modified); ``draft_tokens`` int ``[B, K]``
    and ``draft_probs [B, K, V]`` (the draft's distribution at each proposal); ``num_draft`` int ``[B]``: row b
    uses its first K_b <= K proposals (K_b = 0: plain sampling). Per sequence (scalar or ``[B]``): ``temperature``
    (<= 0: greedy), ``seeds``, ``offsets`` (the sequence index of the first token the step emits), ``top_k``,
    ``top_p``. ``adjust``: the step's logit adjustments as ``areno.engine.logit_adjust.adjust_host`` makes them
    (on the logits' device; min-p comes from it), ``token_state``: the ``LogitAdjuster``'s slots, counted into.
    ``check=False`` skips the one host read (``num_draft``'s range): the call then holds no host sync (a CUDA graph).
    """
    if logits.dim() != 3:
        raise ValueError(f"verify_draft: logits must be [B, K+1, V], got {tuple(logits.shape)}")
    B, K1, V = logits.shape
    K, dev = K1 - 1, logits.device
    if tuple(draft_tokens.shape) != (B, K) or tuple(draft_probs.shape) != (B, K, V):
        raise ValueError(f"verify_draft: draft_tokens [B, K] and draft_probs [B, K, V] for logits {(B, K1, V)}, "
                         f"got {tuple(draft_tokens.shape)}, {tuple(draft_probs.shape)}")  # fmt: skip
    num_draft = _rows(num_draft, B, torch.int64, dev, "num_draft")
    if check and bool(((num_draft < 0) | (num_draft > K)).any()):
        raise ValueError(f"verify_draft: num_draft must be in [0, {K}], got {num_draft.tolist()}")
    if adjust is not None and "pen_slot" in adjust and token_state is None:
        raise ValueError("verify_draft: adjust has penalties but no token_state was given")
    temperature = _rows(temperature, B, torch.float32, dev, "temperature")
    seeds, offsets = _rows(seeds, B, torch.int64, dev, "seeds"), _rows(offsets, B, torch.int64, dev, "offsets")
    top_k, top_p = _rows(top_k, B, torch.int32, dev, "top_k"), _rows(top_p, B, torch.float32, dev, "top_p")
    min_p = None if adjust is None else adjust["min_p"]
    steps = torch.arange(K1, device=dev)
    live = steps[None, :K] < num_draft[:, None]  # [B, K] the row's real proposals
    draft = torch.where(live, draft_tokens.to(torch.int64), 0)

    z = logits.float().clone()
    if adjust is not None:
        _adjust(z, draft, adjust, token_state)
    flat = z.view(B * K1, V)
    per_pos = [None if t is None else t.repeat_interleave(K1, output_size=B * K1)
               for t in (temperature, top_k, top_p, min_p)]
    p = sampling_probs(flat, temperature=per_pos[0], top_k=per_pos[1], top_p=per_pos[2],
                       min_p=per_pos[3]).view(B, K1, V)  # fmt: skip

    n_acc = _accepted(p, draft, draft_probs, live, seeds, offsets)
    last = _last_token(z, p, draft_probs, n_acc, num_draft, temperature, seeds, offsets, top_k,
                       top_p, min_p)  # fmt: skip

    tokens = torch.full((B, K1), -1, dtype=torch.int64, device=dev)
    if K:
        tokens[:, :K] = torch.where(steps[None, :K] < n_acc[:, None], draft, -1)
    tokens[torch.arange(B, device=dev), n_acc] = last
    emitted = steps[None, :] <= n_acc[:, None]
    inv_t = 1.0 / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    lp_all = torch.log_softmax(z * inv_t[:, None, None], dim=-1)
    logprobs = torch.where(emitted, lp_all.gather(2, tokens.clamp(min=0)[:, :, None])[:, :, 0], 0.0)
    if adjust is not None and "pen_slot" in adjust:
        slots = torch.where(emitted, adjust["pen_slot"].to(torch.int64)[:, None], -1)
        record_tokens(token_state, slots.reshape(-1), tokens.clamp(min=0).reshape(-1))
    return Verified(tokens, logprobs, n_acc)
