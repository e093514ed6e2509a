"""Held-out evaluation: greedy accuracy (mean reward) on the dataset's eval/test rows, through the agent if any; and
K samples per prompt of an evaluation set scored as avg@K / pass@k / maj@K (``sample_set``: `areno eval` and
`areno train --eval-dataset-path`)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field

from areno.config import SamplingParams
from areno.rl.eval_metrics import per_prompt, summarize
from areno.rl.rewards import completion_texts, record_from, score

log = logging.getLogger("areno.train")


def evaluate(prompts, rollout, *, tokenizer, reward_fn, cfg, media_of, agent=None) -> float:
    """Mean reward of one greedy answer per Prompt of ``prompts`` (``rollout``: a ``Rollout``)."""
    if agent is not None:  # an agentic task is evaluated through its agent, greedily, one sample each
        rollout.sync()
        rewards = agent.collect(rollout.share(prompts), 1, reward_fn, greedy=True)[2]
        flat = [r for part in rollout.gather(rewards) for r in part]
        return sum(flat) / max(1, len(flat))
    # a seed of its own (greedy ignores it): the engine draws none from the stream the training rollouts use
    greedy = SamplingParams.from_train_config(cfg, n=1, greedy=True, seed=0)
    out = rollout.generate([media_of(p) or p.ids for p in prompts], greedy)
    texts = completion_texts(tokenizer, [group[0] for group in out])
    records = [record_from(p.row, text, group[0].token_ids, i)
               for i, (p, group, text) in enumerate(zip(prompts, out, texts))]
    rewards, _ = score(reward_fn, records, timeout_s=cfg.reward_timeout_s or None)
    return sum(rewards) / len(rewards)


@dataclass
class SetResult:
    """One evaluation set's metrics (``eval_metrics.summarize``), every sample, and the tokens generated."""

    name: str
    metrics: dict
    samples: list[dict] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


def eval_seed(seed: int, name: str, index: int) -> int:
    """The sampling seed of prompt ``index`` of set ``name``: fixed by (seed, name, index) alone, so a prompt's samples
    do not depend on the batch, the other sets or the training run's seed stream (which they never draw from)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()[:8], "little") % 2**62


def answers_of(extract, texts: list[str]) -> list:
    """``extract(text)`` for each text (the reward file's extract_answer), as a string or None; without one the
    stripped text; an extractor that raises gives None for that sample (logged once)."""
    if extract is None:
        return [t.strip() or None for t in texts]
    out = []
    for t in texts:
        try:
            a = extract(t)
        except Exception as e:  # noqa: BLE001 - user code: that sample casts no vote
            if not out or out[-1] is not None:
                log.warning("extract_answer raised %s: %s (the sample casts no maj@K vote)", type(e).__name__, e)
            a = None
        out.append(None if a is None else str(a))
    return out


def sample_set(data, generate, *, tokenizer, reward_fn, extract, params: SamplingParams, seed: int,
               timeout_s=None, on_prompt=None) -> SetResult:
    """``params.n`` samples of every prompt of ``data`` (an ``EvalSet``, tokenized) through ``generate(ids, options,
    on_finished)`` (``Engine.generate``'s call), scored by ``reward_fn``; each prompt seeded by ``eval_seed``."""
    options = [dataclasses.replace(params, seed=eval_seed(seed, data.name, i)) for i in range(len(data.ids))]
    groups = generate(data.ids, options, on_prompt)
    flat = [c for group in groups for c in group]
    texts = completion_texts(tokenizer, flat)
    rows = [row for row, group in zip(data.rows, groups) for _ in group]
    records = [record_from(row, text, c.token_ids, i) for i, (row, text, c) in enumerate(zip(rows, texts, flat))]
    rewards, _ = score(reward_fn, records, timeout_s=timeout_s)
    answers = answers_of(extract, texts)
    values, samples, at = [], [], 0
    for i, group in enumerate(groups):
        k = len(group)
        values.append(per_prompt(rewards[at:at + k], answers[at:at + k]))
        samples += [{"dataset": data.name, "index": i, "sample": j, "prompt": data.rows[i]["prompt"],
                     "completion": texts[at + j], "answer": answers[at + j], "reference": data.rows[i]["answer"],
                     "score": rewards[at + j], "finish_reason": c.finish_reason, "tokens": len(c.token_ids)}
                    for j, c in enumerate(group)]
        at += k
    return SetResult(data.name, summarize(values, seed=seed), samples, sum(len(c.token_ids) for c in flat))


def plot_reward_curve(logger, cfg, since, step: int = 0) -> str | None:
    """reward_curve.png beside metrics.jsonl (RL runs; with W&B also logged there at ``step``); without matplotlib,
    a warning and no plot."""
    from areno.training.metrics import plot_reward_curve as plot

    png = logger.metrics_dir / "reward_curve.png"
    try:
        plot(logger.jsonl_path, png, title=f"{cfg.algo} reward per step", since=since)
    except ImportError as e:
        log.warning("no reward-curve plot: %s (pip install matplotlib); the metrics are in %s", e, logger.jsonl_path)
        return None
    except ValueError as e:  # no reward logged (e.g. no RL step ran)
        log.warning("no reward-curve plot: %s", e)
        return None
    print(f"reward curve: {png}", flush=True)
    if logger.wandb is not None:
        logger.wandb.image("reward_curve", png, step)
    return str(png)


def report_before(stage, accuracy, measured_now: bool, n_rows: int, has_reward: bool) -> None:
    """fit()'s line about the held-out accuracy before training (rank 0); ``measured_now``: evaluate() just ran."""
    if measured_now:
        if accuracy is not None:
            print(f"held-out accuracy before {stage}: {accuracy:.1%} ({n_rows} prompts, greedy)", flush=True)
    elif accuracy is not None:
        print(f"held-out accuracy before {stage}: {accuracy:.1%} (measured before the run was interrupted; kept in "
              "the checkpoint)", flush=True)
    elif not n_rows:
        print("held-out accuracy: not measured: the dataset has no held-out rows (rows whose `split` is eval or "
              "test; a dataset loader can mark some)", flush=True)
    elif not has_reward:
        print("held-out accuracy: not measured: it needs --reward-fn-path to score the held-out rows", flush=True)
