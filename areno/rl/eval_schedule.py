"""Evaluation during training: the --eval-dataset-path sets sampled on the rollout engine before the first step
(--eval-before-training), every --eval-interval steps and after the last, logged as ``eval/<name>/<metric>`` (with
``_lo`` / ``_hi`` interval bounds) to metrics.jsonl, TensorBoard and the reward-curve picture.

Every prompt is sampled with its own seed (``evaluate.eval_seed`` of --seed, the set's name and the prompt's index),
so evaluation never draws from the engine's seed stream: a run with evaluation trains exactly as one without. In
split mode the rollout ranks sample the sets (``RemoteRollout.generate``: this step's weights synced first, the
batches already in flight left as they are) and rank 0 scores them; with --max-staleness K > 0 the policy version
the sets were sampled with is logged too, as ``eval/<name>/policy_version``.
"""

from __future__ import annotations

from areno.config import SamplingParams
from areno.rl.eval_metrics import metric_names
from areno.rl.eval_sets import PromptOptions, load_eval_set, tokenize_set
from areno.rl.evaluate import sample_set

TABLE_ROWS = 256  # samples per set and evaluation in a W&B table
VERSION = "policy_version"  # eval/<name>/policy_version: the policy an async split run's evaluation sampled with


def eval_line(step: int, metrics: dict) -> str:
    """``eval step 10: gsm8k avg@4 61.2% [58.1,64.0] pass@4 ...`` for the sets in ``metrics``."""
    sets: dict[str, dict] = {}
    for key, value in metrics.items():
        _, name, metric = key.split("/", 2)
        sets.setdefault(name, {})[metric] = value
    versions = {m.pop(VERSION) for m in sets.values() if VERSION in m}
    parts = []
    for name, m in sets.items():
        names = metric_names(m)
        top_pass = [n for n in names if n.startswith("pass@")][-1:]
        shown = [f"{n} {100 * m[n]:.1f}% [{100 * m[n + '_lo']:.1f},{100 * m[n + '_hi']:.1f}]"
                 for n in names if not n.startswith("pass@") or n in top_pass]
        parts.append(f"{name} " + " ".join(shown))
    policy = f" (policy version {versions.pop()})" if len(versions) == 1 else ""
    return f"eval step {step}{policy}: " + "; ".join(parts)


class SetEvaluator:
    """The run's evaluation sets (none without --eval-dataset-path) and when to evaluate them."""

    def __init__(self, cfg, tokenizer, reward_fn):
        self.cfg, self.tokenizer, self.reward_fn = cfg, tokenizer, reward_fn
        self.sets, self.extract, self.last_step = [], None, None
        if cfg.eval_dataset_path:
            from areno.training.plugins import load_answer_extractor

            options = PromptOptions(cfg.eval_prompt_field, cfg.eval_answer_field, cfg.eval_prompt_format,
                                    cfg.eval_system_prompt)
            self.sets = [tokenize_set(load_eval_set(name, path, options, flag="--eval-dataset-path"), tokenizer)
                         for name, path in cfg.eval_sets]
            self.extract = load_answer_extractor(cfg.reward_fn_path)

    def due(self, step: int, when: str) -> bool:
        cfg = self.cfg
        if not self.sets or step == self.last_step:
            return False
        if when == "before":
            return step == 0 and cfg.eval_before_training
        if when == "interval":
            return bool(cfg.eval_interval) and step % cfg.eval_interval == 0
        return True  # after the last step, unless that step was just evaluated

    def maybe(self, step: int, rollout, main: bool, logger, *, when: str) -> dict:
        """The sets' metrics if an evaluation is ``due`` at ``step`` (else {}); ``rollout()`` gives the ``Rollout``
        (every rank samples every prompt, as the held-out evaluation); ``main``: this rank prints and logs them to
        ``logger`` at ``step`` (``interval``: the caller logs them with its step's metrics), and with W&B the first
        ``TABLE_ROWS`` samples of each set as a table ``eval/<name>/samples``."""
        if not self.due(step, when):
            return {}
        self.last_step = step
        engine = rollout()
        cfg = self.cfg
        params = SamplingParams.from_train_config(cfg, n=cfg.eval_n_samples, temperature=cfg.eval_temperature)
        metrics = {}
        for data in self.sets:
            result = sample_set(data, lambda ids, opts, cb: engine.generate(ids, opts, on_finished=cb),
                                tokenizer=self.tokenizer, reward_fn=self.reward_fn, extract=self.extract,
                                params=params, seed=cfg.seed, timeout_s=cfg.reward_timeout_s or None)
            metrics.update({f"eval/{data.name}/{k}": v for k, v in result.metrics.items()})
            if cfg.split and cfg.max_staleness:  # the engines may lag the trainer between steps: say which policy
                metrics[f"eval/{data.name}/{VERSION}"] = engine.policy_version
            if main and logger.wandb is not None:
                logger.wandb.table(f"eval/{data.name}/samples", [{"step": step, **r} for r in
                                                                  result.samples[:TABLE_ROWS]], step)
        if main and when != "interval":
            logger.log(step, metrics, stdout=False)
        if main:
            print(eval_line(step, metrics), flush=True)
        return metrics
