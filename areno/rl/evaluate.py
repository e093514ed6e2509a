"""Held-out evaluation: greedy accuracy (mean reward) on the dataset's eval/test rows, through the agent if any."""

from __future__ import annotations

import logging

from areno.config import SamplingParams
from areno.rl.rewards import completion_texts, record_from, score

log = logging.getLogger("areno.train")


def evaluate(prompts, rollout, *, tokenizer, reward_fn, cfg, media_of, agent=None) -> float:
    """Mean reward of one greedy answer per Prompt of ``prompts`` (``rollout``: a ``Rollout``)."""
    if agent is not None:  # an agentic task is evaluated through its agent, greedily, one sample each
        rollout.sync()
        rewards = agent.collect(rollout.share(prompts), 1, reward_fn, greedy=True)[2]
        flat = [r for part in rollout.gather(rewards) for r in part]
        return sum(flat) / max(1, len(flat))
    greedy = SamplingParams.from_train_config(cfg, n=1, greedy=True)
    out = rollout.generate([media_of(p) or p.ids for p in prompts], greedy)
    texts = completion_texts(tokenizer, [group[0] for group in out])
    records = [record_from(p.row, text, group[0].token_ids, i)
               for i, (p, group, text) in enumerate(zip(prompts, out, texts))]
    rewards, _ = score(reward_fn, records, timeout_s=cfg.reward_timeout_s or None)
    return sum(rewards) / len(rewards)


def plot_reward_curve(logger, cfg, since) -> str | None:
    """reward_curve.png beside metrics.jsonl (RL runs); without matplotlib, a warning and no plot."""
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
