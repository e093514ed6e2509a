"""One step's rollout as training rows: sample this rank's share of the prompts, score it, gather every rank's rows.

``StepRollout(rollout, tokenizer, reward_fn, ...)(batch, upcoming)`` is what an RL step calls (``ctx.rollout``): plain
prompts go through the engine (``Rollout.rollout``) with each group scored as soon as it finishes
(``FinishedGroups``); with an agent (--agent-fn) the agent runs the samples (``AgentRollout.collect``).
"""

from __future__ import annotations

import time

from areno.config import SamplingParams
from areno.rl.rollout.finished_groups import FinishedGroups
from areno.training.batch import Row
from areno.training.plugins import stuck_calls


class StepRollout:
    """Turns a step's Prompts into scored rows through a ``Rollout`` (and an ``AgentRollout`` when there is one)."""

    def __init__(self, rollout, tokenizer, reward_fn, cfg, *, media_of, dp_size: int = 1, agent=None, prompts=None):
        self.rollout, self.tokenizer, self.reward_fn, self.cfg = rollout, tokenizer, reward_fn, cfg
        self.media_of, self.dp_size, self.agent = media_of, dp_size, agent
        self.partial = getattr(cfg, "partial_rollout", False)
        self.prompts = prompts or {}  # partial rollout: every Prompt by its dataset index (a group's key)
        self.ahead = None  # agentic rollout sent ahead (split mode, --max-staleness > 0)
        if agent is not None and getattr(cfg, "split", False) and cfg.max_staleness > 0:
            from areno.rl.agentic.ahead import AgentsAhead

            self.ahead = AgentsAhead(agent, cfg.n_samples, reward_fn)
            rollout.background.append(self.ahead.wait)

    def engine_prompt(self, prompt):
        """What the rollout engine takes for a Prompt: its token ids, or its ``MultimodalPrompt``."""
        return self.media_of(prompt) or prompt.ids

    def __call__(self, batch: list, upcoming: list | None = None) -> tuple[list[Row], dict]:
        """Generate n samples per prompt of this rank's share, score them, gather all ranks' rows (``upcoming``:
        the batches of the next steps to send ahead now, async split mode).

        Each prompt group is scored (and its rows tensorised) on a background thread as soon as its samples have
        finished, while the colocated engine decodes the rest (``FinishedGroups``); the stats time the phases:
        ``rollout_s`` the decode, ``reward_s`` the wait for the scores after it, ``reward_work_s`` the whole
        scoring work and ``overlap_saved_s`` the part of it hidden under the decode, ``pack_s`` turning the
        results into rows; ``stuck_calls`` counts the reward calls left running past their timeout (the most of any
        rank)."""
        if self.agent is not None:
            return self.agent_rows(batch, upcoming)
        engine = self.rollout
        mine = engine.share(batch)
        ahead = [[self.engine_prompt(p) for p in engine.share(b)] for b in upcoming] if upcoming else None
        kw = {"keys": {"batch": [p.index for p in mine], "upcoming": [[p.index for p in engine.share(b)]
                                                                      for b in upcoming or []]}} if self.partial else {}
        options = SamplingParams.from_train_config(self.cfg)
        finished = FinishedGroups(mine, options.n, self.tokenizer, self.reward_fn,
                                  timeout_s=self.cfg.reward_timeout_s or None)
        try:
            t0 = time.perf_counter()
            results, split_stats = engine.rollout([self.engine_prompt(p) for p in mine], options, upcoming=ahead,
                                                  on_group=finished.add, **kw)
            t1 = time.perf_counter()
            delivered = split_stats.pop("delivered", None)
            if delivered is not None:  # partial rollout: the groups done now, this batch's and earlier ones' cut tails
                finished.close()
                mine = [self.prompts[k] for k in delivered]
                finished = FinishedGroups(mine, options.n, self.tokenizer, self.reward_fn,
                                          timeout_s=self.cfg.reward_timeout_s or None)
            rewards, failures, tensors = finished.finish(results)
        finally:
            finished.close()
        t2 = time.perf_counter()
        # rows travel as token ids; a prompt's images are found again by its place in the (global) batch (partial
        # rollout: by its dataset index, a group may come from an earlier batch)
        where = {id(p): i for i, p in enumerate(batch)}
        place, prompt_at = ((lambda p: p.index), self.prompts.__getitem__) if self.partial else (
            (lambda p: where[id(p)]), batch.__getitem__)
        flat = [(p, c) for p, group in zip(mine, results) for c in group]
        local = [(p.ids, c.token_ids, c.logprobs, rew, c.finish_reason, place(p), c.routed_experts, c.versions)
                 for (p, c), rew in zip(flat, (r for group in rewards for r in group))]
        parts = engine.gather((local, failures, stuck_calls.count()))
        gathered = [x for part, _, _ in parts for x in part]
        failures = sum(f for _, f, _ in parts)
        n_tok = sum(len(x[1]) for x in gathered)
        rows = [Row(p, list(ids), list(lps), reward=float(rew),
                    meta={"finish_reason": fin, **({"versions": versions} if versions else {})},  # dumps show them
                    media=self.media_of(prompt_at(i)), routed_experts=routes, versions=versions)
                for p, ids, lps, rew, fin, i, routes, versions in gathered]
        if len(parts) == 1:  # this rank's rows only: the tensors made while the rest decoded apply as they are
            made = [t for group, ts in zip(results, tensors) for t in (ts or [None] * len(group))]
            for row, t in zip(rows, made):
                if t is not None:
                    row.ids_tensor, row.logprobs_tensor = t
        stats = {
            "rollout_s": t1 - t0, "reward_s": t2 - t1, "reward_work_s": finished.busy_s,
            "overlap_saved_s": finished.overlap_s, "overlap_groups": finished.early_groups,
            "pack_s": time.perf_counter() - t2, "reward_failures": failures, "samples": len(gathered),
            "stuck_calls": max(s for _, _, s in parts),
            "rollout_tok_s": sum(len(c.token_ids) for _, c in flat) / max(t1 - t0, 1e-9) * self.dp_size,
            "response_len_mean": n_tok / max(1, len(rows)),
            "response_len_max": max((len(r.response_ids) for r in rows), default=0),
            "truncated_frac": sum(x[4] == "length" for x in gathered) / max(1, len(gathered)),
            **split_stats,
        }
        return rows, stats

    def agent_rows(self, batch: list, upcoming: list | None = None) -> tuple[list[Row], dict]:
        """Agentic rollout of this rank's share: one row per trajectory (a fork adds one), each tagged with its
        sample (``extras["sample"]``) so the group advantages stay per sample; the agent's reward, else
        --reward-fn-path on the finished trajectory (its record carries the messages). ``upcoming`` (split mode,
        --max-staleness > 0): the next steps' batches, whose episodes start now on a background thread (``ahead``)
        under the policy just synced; a batch sent ahead earlier is taken from there."""
        if self.ahead is not None and self.ahead.count:  # an earlier step sent this batch (every train rank knows)
            (rows, owner, rewards, failures, stats), waited = self.ahead.take()
            t_roll, sync = stats["agent_s"], {"train_idle_s": waited}
        else:
            sync = self.rollout.sync()  # split mode: the engines get the policy first (every train rank takes part)
            mine = self.rollout.share(batch)
            t0 = time.perf_counter()
            rows, owner, rewards, failures, stats = self.agent.collect(mine, self.cfg.n_samples, self.reward_fn)
            t_roll = time.perf_counter() - t0 - stats["reward_s"]
        if upcoming and self.ahead is not None:  # the new policy first (it waits for the episodes in flight)
            sync.update(self.rollout.sync())
            self.ahead.send([self.rollout.share(b) for b in upcoming])
        stats.update(sync)
        local = [(row.prompt_ids, row.response_ids, row.rollout_logprobs, rewards[i], row.loss_mask, row.meta, i,
                  row.versions) for row, i in zip(rows, owner)]
        parts = self.rollout.gather((local, failures, rewards, stuck_calls.count()))
        out, offset, all_rewards = [], 0, []
        for part, _, part_rewards, _ in parts:  # sample indices made global: rank after rank, as the prompts are
            for p, ids, lps, rew, mask, meta, i, versions in part:
                row = Row(p, list(ids), list(lps), reward=float(rew), loss_mask=list(mask), meta=dict(meta),
                          versions=versions)
                row.extras["sample"] = offset + i
                out.append(row)
            offset += len(part_rewards)
            all_rewards += part_rewards
        stats.update(staleness_of(out, getattr(self.rollout, "step_index", None)))
        stats.update(rollout_s=t_roll, samples=offset,
                     sample_rewards=all_rewards,
                     reward_failures=sum(f for _, f, _, _ in parts),
                     stuck_calls=max(s for *_, s in parts),
                     response_len_mean=sum(len(r.response_ids) for r in out) / max(1, len(out)),
                     response_len_max=max((len(r.response_ids) for r in out), default=0),
                     truncated_frac=sum(r.meta.get("finish_reason") == "length" for r in out) / max(1, len(out)),
                     rollout_tok_s=sum(sum(r.loss_mask) for r in out) / max(t_roll, 1e-9))
        return out, stats


def staleness_of(rows: list[Row], step_index) -> dict:
    """Split mode's ``policy_version`` (the oldest token's) and ``staleness_mean/max`` (per row: how many versions
    its oldest token is older than the step ``step_index()`` trains) of agent rows whose tokens carry versions; {}
    where none do (colocated rollout)."""
    versions = [min(r.versions) for r in rows if r.versions]
    if not versions or step_index is None:
        return {}
    tag = step_index()
    lags = [tag - v for v in versions]
    return {"policy_version": min(versions), "staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags)}
