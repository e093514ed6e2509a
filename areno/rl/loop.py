"""The training loop behind ``areno train``: set-up -> (SFT warm-up) -> steps -> evaluation -> save, for every
algorithm of ``areno.rl.algorithms`` (SFT, DPO, GRPO, GSPO, PPO).

Each step is ``ALGORITHMS[cfg.algo].step(ctx, batch)``: the algorithm's module owns what a step does (rollout,
rewards, advantages, updates); the loop owns the order of things, the metrics, the checkpoints and the stop rules
(``stop_rules``), with the SFT warm-up before the RL steps in ``sft_warmup``.
The rollout is one interface (``areno.rl.rollout.Rollout``) with two implementations: colocated (the engine decodes
with the very parameter tensors the optimizer updates in place, no weight copy) and split (engines on
``--rollout-devices``, the policy streamed to them after each optimizer step). Every step the trainer recomputes the
log-probs of the sampled tokens and logs their difference from the rollout's (``logprob_diff``); truncated importance
sampling uses the same numbers.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from areno.config import ConfigError
from areno.distributed.watchdog import watch_ranks
from areno.engine.build import device_and_dtype
from areno.rl import resume, setup
from areno.rl.algorithms import ALGORITHMS, LOSSES, StepContext, normalise
from areno.rl.eval_schedule import SetEvaluator
from areno.rl.evaluate import evaluate, plot_reward_curve, report_before
from areno.rl.routing_replay import routing_replay_enabled
from areno.rl.sft_warmup import sft_warmup
from areno.rl.stop_rules import check_reward_failures, check_stop
from areno.training import lora
from areno.training.batch import Row
from areno.training.data import Prompt, prompt_ids, tokenize_prompts
from areno.training.multimodal import DatasetMedia, media_limits

log = logging.getLogger("areno.train")


class TrainLoop:
    def __init__(self, cfg, *, model=None, tokenizer=None, sdk=False):
        self.cfg = cfg
        self.algorithm = ALGORITHMS[cfg.algo]
        self.sdk = sdk  # the SDK may bring its own batches: no dataset or reward function required
        self._model, self._tokenizer = model, tokenizer
        self.step_index = 0
        self.engine = None  # the rollout interface (areno.rl.rollout.Rollout): colocated or remote
        self.agent = None  # agentic rollout (--agent-fn)
        self.step_rollout = None  # the RL steps' rollout: engine (or agent) -> scored rows
        self._data_state = None  # the data position a checkpoint records (async split mode reads one batch ahead)
        self.critic_trainer = None
        self.eval_data: list[Prompt] = []
        self.last_save = None
        self.saved_step = self.saved_at = None  # the step and time (monotonic) of the last save
        self.resumed = None  # after a resume: the steps it repeats and the restart count, logged with the next step
        self.started_at = None  # set by setup(): where this run's records start in an appended metrics.jsonl
        self.run_dir = None  # the claimed --save-path (rank 0)
        self.accuracy_before = None  # held-out accuracy of the pre-RL model (kept in checkpoints across resumes)
        self.failed_reward_steps = 0  # consecutive steps in which every reward failed
        self.watchdog = None  # areno.distributed.watchdog.Watchdog of a multi-process run
        self.stop_request = None  # areno.distributed.stop.StopRequest (areno train): a signal saves and stops the run

    # ---- set-up --------------------------------------------------------------------------------------------
    def setup(self):
        cfg, algo = self.cfg, self.algorithm
        inputs = setup.load_user_inputs(cfg, sdk=self.sdk)  # user files first: a bad plugin fails before GPU work
        self.reward_fn, self.agent_fn = inputs.reward_fn, inputs.agent_fn
        self.groups = g = setup.init_groups(cfg)
        self.layout, self.dp_group, self.dp_size, self.is_main = g.layout, g.dp_group, g.dp_size, g.is_main
        self.watchdog = watch_ranks(cfg)  # several ranks: a silent one ends the run after ARENO_RANK_TIMEOUT_S
        if cfg.save_path and self.is_main:  # before any work: one run per folder, writable, no other run's files
            from areno.training.run_dir import claim

            self.run_dir = claim(cfg.save_path, resume=bool(cfg.resume), overwrite=cfg.overwrite,
                                 preset=cfg.preset)
        torch.manual_seed(cfg.seed)
        self.device, self.dtype = device_and_dtype(cfg.dtype)
        self.model, self.tokenizer = setup.load_policy(cfg, self.device, self.dtype, g.tp_group, model=self._model,
                                                       tokenizer=self._tokenizer)
        self.context = setup.check_context(cfg, self.model, inputs)  # before any row is tokenized or step run
        self.media = DatasetMedia(cfg.ckpt, cfg.dataset_path, limits=media_limits(cfg))
        self.rows = self.tokenize(inputs.rows)
        self.eval_data = self.tokenize(inputs.eval_rows)
        self.eval_sets = SetEvaluator(cfg, self.tokenizer, self.reward_fn)  # --eval-dataset-path
        from areno.training.data import PromptIterator

        # with --max-steps the data repeats as needed; otherwise --epochs passes over it
        epochs = None if cfg.max_steps else cfg.epochs
        self.data = PromptIterator(self.rows, cfg.batch_size, seed=cfg.seed, epochs=epochs) if self.rows else None
        self.total_steps = cfg.max_steps or (max(1, len(self.data)) if self.data is not None else 1)
        self.trainer = setup.make_trainer(cfg, self.model, cfg.lr, self.total_steps, g)
        self.trainer.routing_replay = routing_replay_enabled(cfg, self.model)  # the engine records routes to replay
        ref = setup.load_ref(cfg, self.model, self.device, self.dtype, g.tp_group) if (
            algo.needs_ref or cfg.kl_coef > 0) else None
        if algo.uses_critic:
            self.critic_trainer = setup.make_critic_trainer(cfg, self.model, self.total_steps, self.device,
                                                            self.dtype, g)
        self.ctx = StepContext(cfg, self.trainer, self.tokenizer.eos_token_id, self.media_of, ref=ref,
                               critic_trainer=self.critic_trainer, dump=self._dump, dp_group=self.dp_group,
                               dp_size=self.dp_size)
        if (algo.needs_reward and not self.sdk) or cfg.split:  # split: the rollout ranks wait for commands
            self._build_engine()
        self.logger = setup.make_logger(cfg, self.is_main)
        self.setup_at = time.monotonic()  # --save-interval-minutes counts from here until the first save
        self.started_at = time.time()  # metrics.jsonl appends: this run's records are those logged from here on
        if cfg.resume:
            self._resume()

    def tokenize(self, indexed_rows, responses=None, label="rows") -> list[Prompt]:
        return tokenize_prompts([r for _, r in indexed_rows], self.tokenizer, self.media,
                                max_prompt_tokens=self.cfg.max_prompt_tokens,
                                responses=self.algorithm.responses if responses is None else responses,
                                prompt_optional=self.algorithm.prompt_optional,
                                indices=[i for i, _ in indexed_rows], max_tokens=self.context, label=label)

    def _ensure_engine(self):
        """The rollout interface, built on first use (SDK runs and SFT/DPO need none until they sample)."""
        if self.engine is None:
            self._build_engine()
        return self.engine

    def _build_engine(self):
        from areno.rl.rollout import build_rollout
        from areno.rl.rollout.collect import StepRollout

        setup.warn_penalised_rollout(self.cfg)
        self.engine = build_rollout(self.cfg, self.model, self.tokenizer, self.trainer, self.groups,
                                    step_index=lambda: self.step_index)
        if self.agent_fn is not None:
            from areno.engine.tool_calls import format_for
            from areno.rl.agentic import AgentRollout

            self.agent = AgentRollout(self.engine, self.agent_fn, self.tokenizer, self.cfg,
                                      tool_format=format_for(self.model.config.model_type))
        self.step_rollout = StepRollout(self.engine, self.tokenizer, self.reward_fn, self.cfg,
                                        media_of=self.media_of, dp_size=self.dp_size, agent=self.agent,
                                        prompts={p.index: p for p in self.rows})
        self.ctx.rollout = self.step_rollout
        self.ctx.drop_rollout_state = self.engine.drop_rollout_state

    def media_of(self, prompt: Prompt):
        """The ``MultimodalPrompt`` of a Prompt that shows images, else None."""
        return self.media.encode(prompt.row["prompt"], prompt.index) if prompt.has_media else None

    # ---- steps ---------------------------------------------------------------------------------------------
    def step(self, batch: list[Prompt], upcoming: list[list[Prompt]] | None = None) -> dict:
        """One step of ``--algo`` on ``batch`` (``upcoming``: the next steps' batches to send ahead, async split)."""
        if self.algorithm.needs_reward:
            self._ensure_engine()
        self.ctx.step_index = self.step_index
        return self.algorithm.step(self.ctx, batch, upcoming)

    def rollout(self, batch: list[Prompt], upcoming: list[list[Prompt]] | None = None) -> tuple[list[Row], dict]:
        """This step's scored rollout rows and stats (what an RL step gets from ``ctx.rollout``)."""
        self._ensure_engine()
        return self.step_rollout(batch, upcoming)

    def warmup(self) -> dict:
        """``--sft-warmup-steps`` SFT steps on the rows' responses before RL (``sft_warmup``)."""
        return sft_warmup(self)

    # ---- the run -------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """The whole run: SFT warm-up, held-out accuracy before, the steps, accuracy after, the final save; with
        held-out rows, the before/after accuracy is also logged and the reward curve drawn next to metrics.jsonl."""
        cfg = self.cfg
        self.warmup()
        stage = "RL" if self.algorithm.needs_reward else cfg.algo.upper()
        measured = self.accuracy_before is None and bool(self.eval_data)
        if measured:
            self.accuracy_before = self.evaluate()
        if self.is_main:
            report_before(stage, self.accuracy_before, measured, len(self.eval_data), self.reward_fn is not None)
        before = self.accuracy_before
        self.eval_sets.maybe(self.step_index, self._ensure_engine, self.is_main, self.logger, when="before")
        last = self.run()
        self.eval_sets.maybe(self.step_index, self._ensure_engine, self.is_main, self.logger, when="after")
        after = self.evaluate() if self.eval_data else None
        self.results = {"accuracy_before": before, "accuracy_after": after, "last": last,
                        "checkpoint": str(self.last_save) if self.last_save else None, "reward_curve": None}
        if self.is_main and last:
            print("final step: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(last.items())
                                             if isinstance(v, (int, float))), flush=True)
        if self.is_main and before is not None and after is not None:
            self.logger.log(self.step_index, {"eval_accuracy_before": before, "eval_accuracy_after": after},
                            stdout=False)
            print(f"held-out accuracy: before {stage} {before:.1%} -> after {stage} {after:.1%} "
                  f"({(after - before) * 100:+.1f} points)", flush=True)
        if self.is_main and self.algorithm.needs_reward:
            self.results["reward_curve"] = plot_reward_curve(self.logger, cfg, self.started_at, self.step_index)
        if self.is_main and self.last_save:
            print(lora.describe(self.last_save) if cfg.lora_rank else
                  f"checkpoint: {self.last_save} (areno serve --model-path {self.last_save})", flush=True)
        return self.results

    def run(self) -> dict:
        cfg = self.cfg
        if self.data is None:
            raise ConfigError("--dataset-path", "gives no rows to train on")
        bar = tqdm(total=self.total_steps, initial=self.step_index, disable=not self.is_main, desc=cfg.algo,
                   dynamic_ncols=True)
        try:
            last = self._steps(bar)
        finally:
            bar.close()  # before any error message, so the message is the last line
        if cfg.save_path and self.saved_step != self.step_index:
            self.save()
        return last

    def _steps(self, bar) -> dict:
        cfg = self.cfg
        last = {}
        batches = iter(self.data)
        # async split (--max-staleness K): the next K steps' batches sent ahead, each after its data position
        ahead, depth = collections.deque(), cfg.max_staleness if cfg.split and self.algorithm.needs_reward else 0
        read_ahead(ahead, batches, self.data, self.engine.in_flight_count() if self.engine is not None else 0)
        while self.step_index < self.total_steps:  # test first: a batch taken is a batch consumed
            batch = ahead.popleft()[1] if ahead else next(batches, None)
            if batch is None:
                break
            upcoming = read_ahead(ahead, batches, self.data, min(depth, self.total_steps - self.step_index - 1))
            self._data_state = ahead[0][0] if ahead else None
            t0 = time.perf_counter()
            m = self.step(batch, upcoming or None)
            self.step_index += 1
            m["step_s"] = time.perf_counter() - t0
            if torch.cuda.is_available():
                m["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if cfg.eval_interval and self.step_index % cfg.eval_interval == 0:
                acc = self.evaluate()
                if acc is not None:
                    m["eval_accuracy"] = acc
            evals = self.eval_sets.maybe(self.step_index, self._ensure_engine, self.is_main, self.logger,
                                         when="interval")
            m.update(evals)
            if self.step_index % max(1, cfg.log_interval) == 0 or evals:  # an evaluation's step is always logged
                self.logger.log(self.step_index, {**m, **(self.resumed or {})})
                self.resumed = None  # logged once
            due = resume.save_due(cfg, self.saved_at or self.setup_at, self.groups.train_group)  # every rank
            saved = bool(cfg.save_path and (due or cfg.save_interval and self.step_index % cfg.save_interval == 0))
            if saved:
                self.save()
            bar.update(1)
            last = m
            check_reward_failures(self, m, saved)
            check_stop(self, saved)
        return last

    def _dump(self, rows: list[Row], m: dict) -> None:
        """``--rollout-dump-dir``: this step's rows as JSON lines (rank 0)."""
        folder = self.cfg.rollout_dump_dir
        if not folder or not self.is_main:
            return
        path = Path(folder) / f"step-{self.step_index + 1}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        version = m.get("policy_version", self.step_index)
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                rec = {"prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
                       "loss_mask": r.loss_mask if r.loss_mask is not None else [1] * len(r.response_ids),
                       "rollout_logprobs": r.rollout_logprobs, "policy_version": version, "reward": r.reward,
                       **{k: v for k, v in r.meta.items() if k != "item"}}
                f.write(json.dumps(rec, default=str) + "\n")

    # ---- evaluation and checkpoints ------------------------------------------------------------------------
    def evaluate(self, prompts: list[Prompt] | None = None) -> float | None:
        """Greedy accuracy (mean reward) on the held-out rows (``split`` eval/test in the dataset)."""
        prompts = self.eval_data if prompts is None else prompts
        if not prompts or (self.reward_fn is None and self.agent_fn is None):
            return None
        return evaluate(prompts, self._ensure_engine(), tokenizer=self.tokenizer, reward_fn=self.reward_fn,
                        cfg=self.cfg, media_of=self.media_of, agent=self.agent)

    def save(self, path=None):
        data = self._data_state or (self.data.state_dict() if self.data is not None else None)
        state = {"step": self.step_index, "data": data, "accuracy_before": self.accuracy_before,
                 "started_at": self.started_at, "failed_reward_steps": self.failed_reward_steps}
        self.last_save = resume.save(path or Path(self.cfg.save_path) / f"step-{self.step_index}", cfg=self.cfg,
                                      model=self.model, tokenizer=self.tokenizer, trainer=self.trainer, state=state,
                                      rollout=self.engine, group=self.groups.train_group)
        self.saved_step, self.saved_at = self.step_index, time.monotonic()
        return self.last_save

    def _resume(self):
        path, state = resume.restore(self.cfg, model=self.model, trainer=self.trainer, device=self.device,
                                     dtype=self.dtype, tp_group=self.groups.tp_group,
                                     train_group=self.groups.train_group)
        self.step_index = state["step"]
        self.data.load_state_dict(state["data"])
        self.accuracy_before = state.get("accuracy_before")
        self.failed_reward_steps = state.get("failed_reward_steps", 0)
        self.started_at = state.get("started_at") or self.started_at
        if self.algorithm.needs_reward:
            self._ensure_engine()
        if self.engine is not None:
            self.engine.policy_changed()  # split mode: the engines still hold --ckpt's weights
        rank_state = state.get("rank_state") or {}
        if rank_state.get("engine_rng") is not None and self.engine is not None:
            self.engine.set_rng_state(rank_state["engine_rng"])
        if self.engine is not None:  # async split: the rollout the checkpoint's step had sent ahead
            self.engine.restore_in_flight(rank_state.get("in_flight"))
        # the interrupted run's lines after this checkpoint go; the first step logged from here says how many
        self.resumed = {"repeated_steps": self.logger.truncate_after(self.step_index),
                        "restarts": resume.restart_count()}
        log.info("resumed from %s at step %d", path, self.step_index)

    # ---- SDK entry points ----------------------------------------------------------------------------------
    def prompt_ids(self, prompt) -> list[int]:
        return prompt_ids(self.tokenizer, prompt)

    def generate(self, prompt_ids: list[list[int]], options):
        return self._ensure_engine().generate(prompt_ids, options)

    def train_rows(self, batch, loss_fn, mini_bs, grad_accum, *, epochs=1, entropy=False) -> dict:
        rows = [b if isinstance(b, Row) else Row(list(b["prompt_ids"]), list(b["response_ids"]),
                                                 b.get("rollout_logprobs"), float(b.get("advantage", 0.0)),
                                                 float(b.get("reward", 0.0))) for b in batch]
        if isinstance(loss_fn, str):
            if loss_fn not in LOSSES:
                raise ConfigError("loss_fn", f"names an unknown loss {loss_fn!r}; known: {', '.join(LOSSES)}")
            loss_fn = LOSSES[loss_fn](self.cfg)
        return normalise(self.trainer.train(rows, loss_fn, mini_bs, grad_accum, epochs=epochs, entropy=entropy))

    def close(self):
        """Release what setup() built so far (it may have stopped part-way on a bad input)."""
        if self.watchdog is not None:
            self.watchdog.close()  # before the rollout ranks are told to stop: their exit is no silence
        if self.engine is not None:
            self.engine.close()  # split mode: the rollout ranks leave their loop
        if self.agent is not None:
            self.agent.close()
        if hasattr(self, "logger"):
            self.logger.close()
        if hasattr(self, "trainer"):
            self.trainer.close()
        if self.critic_trainer is not None:
            self.critic_trainer.close()
        if self.run_dir is not None:
            self.run_dir.release()
            self.run_dir = None


def read_ahead(ahead, batches, data, depth: int) -> list:
    """Fill ``ahead`` (the batches sent ahead, each after the data position before it) up to ``depth`` batches from
    ``batches``; returns the batches added."""
    upcoming = []
    while len(ahead) < depth:
        state = data.state_dict()
        nxt = next(batches, None)
        if nxt is None:
            break
        ahead.append((state, nxt))
        upcoming.append(nxt)
    return upcoming

