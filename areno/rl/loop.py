"""The training loop behind ``areno train``: data -> rollout -> rewards -> advantages -> updates -> metrics ->
checkpoints, for SFT, DPO, GRPO, GSPO and PPO.

The loop talks to one rollout interface with two implementations: colocated (``rollout_colocated``: the engine
decodes with the very parameter tensors the optimizer updates in place, no weight copy) and split
(``rollout_remote``: engines on ``--rollout-devices``, the policy streamed to them after each optimizer step). Every
step the trainer recomputes the log-probs of the sampled tokens and logs their difference from the rollout's
(``logprob_diff``); truncated importance sampling uses the same numbers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from areno.config import ConfigError, RunError
from areno.distributed.collectives import gather_objects, group_rank, group_size
from areno.rl import algorithms
from areno.rl.advantages import gae, group_advantages
from areno.rl.losses import value_loss
from areno.rl.routing_replay import routing_replay_enabled
from areno.training import multimodal
from areno.training.batch import Row
from areno.training.multimodal import DatasetMedia, media_limits
from areno.training.trainer import PolicyTrainer

log = logging.getLogger("areno.train")
RL_ALGOS = ("grpo", "gspo", "ppo")


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dtype(cfg, device) -> torch.dtype:
    if cfg.dtype:
        return getattr(torch, cfg.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sampling_adjustments(cfg) -> dict:
    """The rollout's --min-p and penalties as SamplingOptions fields (rollout and agentic sampling alike)."""
    return {"min_p": cfg.min_p, "repetition_penalty": cfg.repetition_penalty,
            "presence_penalty": cfg.presence_penalty, "frequency_penalty": cfg.frequency_penalty}


class TrainLoop:
    def __init__(self, cfg, *, model=None, tokenizer=None, sdk=False):
        self.cfg = cfg
        self.sdk = sdk  # the SDK may bring its own batches: no dataset or reward function required
        self._model, self._tokenizer = model, tokenizer
        self.step_index = 0
        self.engine = None  # the rollout interface: ColocatedRollout or RemoteRollout
        self.agent = None  # agentic rollout (--agent-fn) on the colocated engine
        self.layout = None  # split mode's process layout (parallel.SplitLayout)
        self._data_state = None  # the data position a checkpoint records (async split mode reads one batch ahead)
        self.critic = None
        self.eval_rows: list[dict] = []
        self.last_save = None
        self.started_at = None  # set by setup(): where this run's records start in an appended metrics.jsonl
        self.run_dir = None  # the claimed --save-path (rank 0)
        self.accuracy_before = None  # held-out accuracy of the pre-RL model (kept in checkpoints across resumes)
        self.failed_reward_steps = 0  # consecutive steps in which every reward failed

    # ---- set-up --------------------------------------------------------------------------------------------
    def setup(self):
        from areno.distributed import parallel
        from areno.training.data import PromptIterator, check_rows, load_rows
        from areno.training.plugins import load_agent, load_dataset_loader, load_reward_fn

        cfg = self.cfg
        if not self.sdk:
            cfg.require_run_inputs()
        # user files first: a bad plugin fails before any GPU work
        self.reward_fn = load_reward_fn(cfg.reward_fn_path) if cfg.reward_fn_path else None
        self.agent_fn = load_agent(cfg.agent_fn) if cfg.agent_fn else None
        loader = load_dataset_loader(cfg.dataset_loader_fn) if cfg.dataset_loader_fn else None
        rows = load_rows(cfg.dataset_path, loader_fn=loader) if (cfg.dataset_path or loader) else []
        for i, r in enumerate(rows):  # the dataset row index, named by errors (and the media cache's key)
            if isinstance(r, dict):
                r.setdefault("_row", i)
        self.eval_rows = [r for r in rows if r.get("split") in ("eval", "test")]
        rows = [r for r in rows if r.get("split") not in ("eval", "test")]
        if rows or not self.sdk:
            check_rows(rows, cfg.algo)
        if self.reward_fn is None and self.agent_fn is None and cfg.algo in RL_ALGOS and not self.sdk:
            raise ConfigError("--reward-fn-path", f"is required for --algo {cfg.algo}")

        device = self._pinned_device()
        if device is not None:
            torch.cuda.set_device(device)
        if cfg.split:
            self.layout = parallel.init_split(cfg.world_size, cfg.tp_size, cfg.rollout_tp, device=device)
        elif cfg.world_size > 1:
            parallel.init_distributed(tp_size=cfg.tp_size, device=device)
        self.tp_group = parallel.get_tp_group() if cfg.tp_size > 1 else None
        self.dp_group = parallel.get_dp_group() if cfg.world_size // cfg.tp_size > 1 else None
        self.dp_rank, self.dp_size = group_rank(self.dp_group), group_size(self.dp_group)
        self.is_main = parallel.is_main_process()
        self.train_group = self.layout.train_group if self.layout is not None else None  # None: the whole world
        if cfg.save_path and self.is_main:  # before any work: one run per folder, writable, no other run's files
            from areno.training.run_dir import claim

            self.run_dir = claim(cfg.save_path, resume=bool(cfg.resume), overwrite=cfg.overwrite)
        torch.manual_seed(cfg.seed)

        self.device = _device()
        self.dtype = _dtype(cfg, self.device)
        self.model, self.tokenizer = self._load_policy()
        self.media = DatasetMedia(cfg.ckpt, cfg.dataset_path, limits=media_limits(cfg))
        self.rows = self._tokenize(rows)
        self.eval_data = self._tokenize(self.eval_rows)
        # with --max-steps the data repeats as needed; otherwise --epochs passes over it
        epochs = None if cfg.max_steps else cfg.epochs
        self.data = PromptIterator(self.rows, cfg.batch_size, seed=cfg.seed, epochs=epochs) if self.rows else None
        total = cfg.max_steps or (max(1, len(self.data)) if self.data is not None else 1)
        self.total_steps = total
        self.trainer = self._make_trainer(self.model, cfg.lr, total)
        self.trainer.routing_replay = routing_replay_enabled(cfg, self.model)  # the engine records routes to replay
        self.ref = self._load_ref() if (cfg.algo == "dpo" or cfg.kl_coef > 0) else None
        if cfg.algo == "ppo":
            self._setup_critic(total)
        if (cfg.algo in RL_ALGOS and not self.sdk) or cfg.split:  # split: the rollout ranks wait for commands
            self._build_engine()
        self.logger = self._make_logger()
        self.started_at = time.time()  # metrics.jsonl appends: this run's records are those logged from here on
        if cfg.resume:
            self._resume()

    def _pinned_device(self) -> int | None:
        """This rank's GPU from ``--train-devices`` (one per rank, in order); None: the launcher's choice, or no GPU
        (on a CPU host the indices name process slots, so the flag changes nothing there)."""
        from areno.distributed.parallel import rank_device

        if not self.cfg.train_devices:
            return None
        return rank_device(self.cfg.train_devices, int(os.environ.get("RANK", "0")))

    def _load_policy(self):
        from areno.models import load_model, load_tokenizer

        cfg = self.cfg
        try:
            model = self._model or load_model(cfg.ckpt, dtype=self.dtype, device=self.device, tp_group=self.tp_group,
                                              attn_backend=cfg.attn_backend)
            tok = self._tokenizer or load_tokenizer(cfg.ckpt)
        except (OSError, KeyError, ValueError) as e:  # missing folder, unresolvable hub id, foreign checkpoint
            raise ConfigError("--ckpt", f"{cfg.ckpt!r} cannot be loaded: {e}") from e
        multimodal.check_flags(cfg, model)
        multimodal.freeze(model, cfg)  # the tower and projector stay frozen (and in eval mode) unless unfrozen
        model.train()
        if hasattr(model, "set_activation_checkpointing"):
            model.set_activation_checkpointing(cfg.activation_checkpointing)
        return model, tok

    def _load_ref(self):
        from areno.models import load_model

        cfg = self.cfg
        ref = load_model(cfg.ref_ckpt or cfg.ckpt, dtype=self.dtype, device=self.device, tp_group=self.tp_group,
                         attn_backend=cfg.attn_backend) if (cfg.ref_ckpt or cfg.ckpt) else _frozen_copy(self.model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _make_trainer(self, model, lr, total):
        from areno.training.optimizer import MasterAdamW
        from areno.training.schedule import LRSchedule

        cfg = self.cfg
        params = multimodal.optimizer_params(model)  # frozen parts have no optimizer state
        opt = MasterAdamW(params, lr=lr, weight_decay=cfg.weight_decay, dp_group=self.dp_group,
                          tp_group=self.tp_group, offload=cfg.optimizer_state_offload,
                          offload_dir=cfg.optimizer_state_offload_dir,
                          offload_batch_size=cfg.optimizer_state_offload_batch_size)
        rl = cfg.algo in RL_ALGOS
        updates_per_step = self._updates_per_step(cfg.batch_size * (cfg.n_samples if rl else 1)) * max(
            1, cfg.ppo_epochs if rl else 1)
        sched = LRSchedule(lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=total * updates_per_step,
                           style=cfg.lr_decay_style)
        bias_rate = 0.0 if getattr(model, "is_value_model", False) else cfg.router_bias_update_rate
        if bias_rate and not hasattr(model, "update_routing_bias"):
            raise ConfigError("--router-bias-update-rate", f"the {model.config.model_type} policy has no MoE "
                              "selection bias to update (Ling 3, bailing_hybrid, has one)")
        groups = multimodal.group_schedules(cfg, opt.groups, lr=lr, total_updates=total * updates_per_step)
        graphs = "off" if getattr(model, "is_value_model", False) else cfg.train_cuda_graphs  # the critic: eager
        if graphs == "auto" and rl and not cfg.split:
            # colocated RL: the rollout engine's KV cache shares the GPU, and a graphed step reserves more than the
            # eager one (its memory pool stays between updates); eager until measured at G1 (--train-cuda-graphs on)
            graphs = "off"
        if graphs == "on":
            from areno.training.graphs import unsupported

            why = unsupported(model, tp_group=self.tp_group)
            if why:
                raise ConfigError("--train-cuda-graphs", f"on does not apply to this run: {why}")
        trainer = PolicyTrainer(model, opt, sched, temperature=self._logprob_temperature(), grad_clip=cfg.grad_clip,
                                dp_group=self.dp_group, tp_group=self.tp_group, router_bias_update_rate=bias_rate,
                                group_schedules=groups, train_cuda_graphs=graphs)
        return trainer

    def _updates_per_step(self, units: int) -> int:
        """Optimizer updates one train() pass makes over ``units`` rows (pairs for DPO): the decay schedules count
        updates, so their length is steps x this (x epochs)."""
        cfg = self.cfg
        return max(1, -(-units // (cfg.mini_bs * cfg.gradient_accumulation_steps * self.dp_size)))

    def _logprob_temperature(self) -> float:
        t = self.cfg.temperature
        return t if t and t > 0 and self.cfg.algo in RL_ALGOS else 1.0

    def _setup_critic(self, total):
        from areno.rl.critic import ValueModel

        cfg = self.cfg
        self.critic = ValueModel.from_policy(cfg.critic_ckpt or cfg.ckpt, self.model, dtype=self.dtype,
                                             device=self.device, tp_group=self.tp_group)
        multimodal.freeze(self.critic, cfg)
        if hasattr(self.critic.backbone, "set_activation_checkpointing"):
            self.critic.backbone.set_activation_checkpointing(cfg.activation_checkpointing)
        self.critic_trainer = self._make_trainer(self.critic, cfg.critic_lr or cfg.lr, total)

    def _build_engine(self):
        if self.cfg.repetition_penalty != 1.0 or self.cfg.presence_penalty or self.cfg.frequency_penalty:
            log.warning("rollout with --repetition-penalty/--presence-penalty/--frequency-penalty: the rollout "
                        "log-probs are those of the penalised distribution the tokens were drawn from, the trainer's "
                        "those of the plain policy, so logprob_diff includes the penalty and --tis-cap's importance "
                        "weights correct for it as off-policy sampling")
        if self.cfg.split:
            from areno.rl.rollout_remote import RemoteRollout

            self.engine = RemoteRollout(self, self.layout)
        else:
            from areno.rl.rollout_colocated import ColocatedRollout

            self.engine = ColocatedRollout(self)
        if self.agent_fn is not None:
            from areno.rl.agentic import AgentRollout

            self.agent = AgentRollout(self, self.agent_fn)

    def _make_logger(self):
        from areno.training.metrics import MetricsLogger

        cfg = self.cfg
        logger = MetricsLogger(cfg.metrics_folder, tensorboard=cfg.tensorboard, rank=0 if self.is_main else 1)
        if self.is_main:  # the whole resolved configuration lives with the run (stdout shows it with --verbose)
            (logger.metrics_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str) + "\n")
        return logger

    # ---- data ----------------------------------------------------------------------------------------------
    def prompt_ids(self, prompt) -> list[int]:
        tok = self.tokenizer
        if isinstance(prompt, list):
            text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        else:
            text = prompt
        return tok.encode(text, add_special_tokens=False)

    def _tokenize(self, rows):
        cfg, out, dropped = self.cfg, [], 0
        eos = self.tokenizer.eos_token_id
        for r in rows:
            r = dict(r)
            if self.media.has_media(r.get("prompt")):  # images: the processor's ids (placeholders expanded)
                r["_prompt_ids"], r["_media"] = self.media.encode(r).input_ids, True
            elif r.get("prompt") is not None or cfg.algo != "dpo":
                r["_prompt_ids"] = self.prompt_ids(r["prompt"])
            else:
                r["_prompt_ids"] = []
            if cfg.algo == "dpo":
                r["_chosen"] = self._response_ids(r["chosen"], eos)
                r["_rejected"] = self._response_ids(r["rejected"], eos)
            elif cfg.algo == "sft":
                r["_response_ids"] = self._response_ids(r["response"], eos)
            if len(r["_prompt_ids"]) > cfg.max_prompt_tokens or (cfg.algo != "dpo" and not r["_prompt_ids"]):
                dropped += 1
                self.media.forget(r)
                continue
            out.append(r)
        if dropped:
            log.warning("dropped %d rows whose prompt is empty or longer than --max-prompt-tokens %d", dropped,
                        cfg.max_prompt_tokens)
        return out

    def row_media(self, row: dict):
        """The ``MultimodalPrompt`` of a dataset row whose prompt shows images, else None."""
        return self.media.encode(row) if row.get("_media") else None

    def engine_prompt(self, row: dict):
        """What the rollout engine takes for a row's prompt: its token ids, or its ``MultimodalPrompt``."""
        return self.row_media(row) or row["_prompt_ids"]

    def _response_ids(self, response, eos):
        if isinstance(response, list):  # chat messages: the assistant text
            response = "".join(m.get("content", "") for m in response if m.get("role") == "assistant")
        ids = self.tokenizer.encode(response, add_special_tokens=False)
        return ids + ([eos] if eos is not None else [])

    # ---- SDK entry points ----------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], options):
        if self.engine is None:
            self._build_engine()
        return self.engine.generate(prompt_ids, options)

    def train_rows(self, batch, loss_fn, mini_bs, grad_accum, *, epochs=1, entropy=False) -> dict:
        rows = [b if isinstance(b, Row) else Row(list(b["prompt_ids"]), list(b["response_ids"]),
                                                 b.get("rollout_logprobs"), float(b.get("advantage", 0.0)),
                                                 float(b.get("reward", 0.0))) for b in batch]
        if isinstance(loss_fn, str):
            cfg = self.cfg
            builders = {"sft": algorithms.sft_loss_fn, "grpo": lambda: algorithms.grpo_loss_fn(cfg),
                        "gspo": lambda: algorithms.gspo_loss_fn(cfg)}
            if loss_fn not in builders:
                raise ConfigError("loss_fn", f"names an unknown loss {loss_fn!r}; known: {', '.join(builders)}")
            loss_fn = builders[loss_fn]()
        return _normalise(self.trainer.train(rows, loss_fn, mini_bs, grad_accum, epochs=epochs, entropy=entropy))

    def fit(self) -> dict:
        """The whole run: SFT warm-up, held-out accuracy before, the steps, accuracy after, the final save; with
        held-out rows, the before/after accuracy is also logged and the reward curve drawn next to metrics.jsonl."""
        cfg = self.cfg
        self.warmup()
        stage = "RL" if cfg.algo in RL_ALGOS else cfg.algo.upper()
        if self.accuracy_before is None and self.eval_data:
            self.accuracy_before = self.evaluate()
            if self.is_main and self.accuracy_before is not None:
                print(f"held-out accuracy before {stage}: {self.accuracy_before:.1%} ({len(self.eval_data)} prompts, "
                      "greedy)", flush=True)
        elif self.is_main and self.accuracy_before is not None:
            print(f"held-out accuracy before {stage}: {self.accuracy_before:.1%} (measured before the run was "
                  "interrupted; kept in the checkpoint)", flush=True)
        elif self.is_main and not self.eval_data:
            print("held-out accuracy: not measured: the dataset has no held-out rows (rows whose `split` is eval or "
                  "test; a dataset loader can mark some)", flush=True)
        elif self.is_main and self.reward_fn is None:
            print("held-out accuracy: not measured: it needs --reward-fn-path to score the held-out rows", flush=True)
        before = self.accuracy_before
        last = self.run()
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
        if self.is_main:
            self.results["reward_curve"] = self._plot_reward_curve()
        if self.is_main and self.last_save:
            print(f"checkpoint: {self.last_save} (areno serve --model-path {self.last_save})", flush=True)
        return self.results

    def _plot_reward_curve(self):
        """reward_curve.png beside metrics.jsonl (RL runs); without matplotlib, a warning and no plot."""
        from areno.training.metrics import plot_reward_curve

        if self.cfg.algo not in RL_ALGOS:
            return None
        png = self.logger.metrics_dir / "reward_curve.png"
        try:
            plot_reward_curve(self.logger.jsonl_path, png, title=f"{self.cfg.algo} reward per step",
                              since=self.started_at)
        except ImportError as e:
            log.warning("no reward-curve plot: %s (pip install matplotlib); the metrics are in %s", e,
                        self.logger.jsonl_path)
            return None
        except ValueError as e:  # no reward logged (e.g. no RL step ran)
            log.warning("no reward-curve plot: %s", e)
            return None
        print(f"reward curve: {png}", flush=True)
        return str(png)

    # ---- rollout -------------------------------------------------------------------------------------------
    def sampling_options(self, n=None, greedy=False):
        from areno.engine.sequence import SamplingOptions

        cfg = self.cfg
        return SamplingOptions(
            temperature=0.0 if greedy else cfg.temperature, top_p=cfg.top_p, top_k=max(0, cfg.top_k),
            max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens, stop=cfg.stop or [],
            n=n or cfg.n_samples, **sampling_adjustments(cfg),
        )

    def rollout(self, batch: list[dict], upcoming: list[dict] | None = None) -> tuple[list[Row], dict]:
        """Generate n samples per prompt of this rank's share, score them, gather all ranks' rows (``upcoming``:
        the next step's prompts, sent ahead in async split mode).

        Each prompt group is scored (and its rows tensorised) on a background thread as soon as its samples have
        finished, while the colocated engine decodes the rest (``FinishedGroups``); the stats time the phases:
        ``rollout_s`` the decode, ``reward_s`` the wait for the scores after it, ``reward_work_s`` the whole
        scoring work and ``overlap_saved_s`` the part of it hidden under the decode, ``pack_s`` turning the
        results into rows."""
        from areno.rl.finished_groups import FinishedGroups

        if self.engine is None:
            self._build_engine()
        if self.agent is not None:
            return self._agent_rollout(batch)
        mine = self.engine.share(batch)
        ahead = [self.engine_prompt(r) for r in self.engine.share(upcoming)] if upcoming is not None else None
        options = self.sampling_options()
        finished = FinishedGroups(mine, options.n, self.tokenizer, self.reward_fn,
                                  timeout_s=self.cfg.reward_timeout_s or None)
        try:
            t0 = time.perf_counter()
            report = {} if self.engine.split else {"on_group": finished.add}
            results, split_stats = self.engine.rollout([self.engine_prompt(r) for r in mine], options,
                                                       upcoming=ahead, **report)
            t1 = time.perf_counter()
            rewards, failures, tensors = finished.finish(results)
        finally:
            finished.close()
        t2 = time.perf_counter()
        # rows travel as token ids; a prompt's images are found again by its place in the (global) batch
        where = {id(r): i for i, r in enumerate(batch)}
        flat = [(row, c) for row, group in zip(mine, results) for c in group]
        local = [(row["_prompt_ids"], c.token_ids, c.logprobs, rew, c.finish_reason, where[id(row)],
                  c.routed_experts) for (row, c), rew in zip(flat, (r for group in rewards for r in group))]
        parts = self.engine.gather((local, failures))
        gathered = [x for part, _ in parts for x in part]
        failures = sum(f for _, f in parts)
        n_tok = sum(len(x[1]) for x in gathered)
        rows = [Row(p, list(ids), list(lps), reward=float(rew), meta={"finish_reason": fin},
                    media=self.row_media(batch[i]), routed_experts=routes)
                for p, ids, lps, rew, fin, i, routes in gathered]
        if len(parts) == 1:  # this rank's rows only: the tensors made while the rest decoded apply as they are
            made = [t for group, ts in zip(results, tensors) for t in (ts or [None] * len(group))]
            for row, t in zip(rows, made):
                if t is not None:
                    row.ids_tensor, row.logprobs_tensor = t
        stats = {
            "rollout_s": t1 - t0, "reward_s": t2 - t1, "reward_work_s": finished.busy_s,
            "overlap_saved_s": finished.overlap_s, "overlap_groups": finished.early_groups,
            "pack_s": time.perf_counter() - t2, "reward_failures": failures, "samples": len(gathered),
            "rollout_tok_s": sum(len(c.token_ids) for _, c in flat) / max(t1 - t0, 1e-9) * self.dp_size,
            "response_len_mean": n_tok / max(1, len(rows)),
            "response_len_max": max((len(r.response_ids) for r in rows), default=0),
            "truncated_frac": sum(x[4] == "length" for x in gathered) / max(1, len(gathered)),
            **split_stats,
        }
        return rows, stats

    def _agent_rollout(self, batch: list[dict]) -> tuple[list[Row], dict]:
        """Agentic rollout of this rank's share: one row per trajectory (a fork adds one), each tagged with its
        sample (``extras["sample"]``) so the group advantages stay per sample; the agent's reward, else
        --reward-fn-path on the finished trajectory (its record carries the messages)."""
        sync = self.engine.sync()  # split mode: the engines get the policy first (every train rank takes part)
        mine = self.engine.share(batch)
        t0 = time.perf_counter()
        rows, owner, rewards, failures, stats = self.agent.collect(mine, self.cfg.n_samples, self.reward_fn)
        stats.update(sync)
        t_roll = time.perf_counter() - t0 - stats["reward_s"]
        local = [(row.prompt_ids, row.response_ids, row.rollout_logprobs, rewards[i], row.loss_mask, row.meta, i)
                 for row, i in zip(rows, owner)]
        parts = self.engine.gather((local, failures, rewards))
        out, offset, all_rewards = [], 0, []
        for part, _, part_rewards in parts:  # sample indices made global: rank after rank, as the prompts are
            for p, ids, lps, rew, mask, meta, i in part:
                row = Row(p, list(ids), list(lps), reward=float(rew), loss_mask=list(mask), meta=dict(meta))
                row.extras["sample"] = offset + i
                out.append(row)
            offset += len(part_rewards)
            all_rewards += part_rewards
        stats.update(rollout_s=t_roll, samples=offset,
                     sample_rewards=all_rewards,
                     reward_failures=sum(f for _, f, _ in parts),
                     response_len_mean=sum(len(r.response_ids) for r in out) / max(1, len(out)),
                     response_len_max=max((len(r.response_ids) for r in out), default=0),
                     truncated_frac=sum(r.meta.get("finish_reason") == "length" for r in out) / max(1, len(out)),
                     rollout_tok_s=sum(sum(r.loss_mask) for r in out) / max(t_roll, 1e-9))
        return out, stats

    # ---- steps ---------------------------------------------------------------------------------------------
    def step_rl(self, batch, upcoming=None) -> dict:
        cfg = self.cfg
        rows, m = self.rollout(batch, upcoming)
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
        if cfg.filter_zero_variance_groups and cfg.algo != "ppo":
            zero = zero_var.tolist()
            rows = [r for r, s in zip(rows, sample) if not zero[s // cfg.n_samples]]
        self._dump(rows, m)
        rows = [r for r in rows if r.response_ids and (r.loss_mask is None or any(r.loss_mask))]
        if not rows:
            m["skipped"] = 1
            return m
        t0 = time.perf_counter()
        m["pack_s"] = m.get("pack_s", 0.0) + t0 - t_rows  # rows, advantages, filters: host time before the update
        # One optimizer update per rollout batch: the update's own forward (detached) is the trainer's view of the
        # rollout tokens, so the separate no-grad pass is skipped (same weights, same kernels, same numbers).
        inline = self._single_update(rows)
        if not inline:
            prox = self.trainer.compute_logprobs(rows, cfg.mini_bs)  # the trainer's view of the rollout tokens
            diffs = [abs(a - b) for r, p in zip(rows, prox) for a, b in zip(p, r.scored(r.rollout_logprobs))]
            m["logprob_diff"] = sum(diffs) / max(1, len(diffs))
            m["logprob_diff_max"] = max(diffs, default=0.0)
            for r, p in zip(rows, prox):
                if cfg.tis_cap > 0:
                    r.extras["tis"] = r.spread([min(math.exp(a - b), cfg.tis_cap)
                                                for a, b in zip(p, r.scored(r.rollout_logprobs))])
        if self.ref is not None:
            for r, p in zip(rows, self.trainer.compute_logprobs(rows, cfg.mini_bs, model=self.ref)):
                r.extras["ref"] = r.spread(p)
        m["logprob_s"] = time.perf_counter() - t0
        if cfg.algo == "ppo":
            m.update(self._ppo_values(rows))
            loss_fn = algorithms.grpo_loss_fn(cfg, dual_clip=cfg.dual_clip)
        elif cfg.algo == "gspo":
            loss_fn = algorithms.gspo_loss_fn(cfg)
        else:
            loss_fn = algorithms.grpo_loss_fn(cfg)
        if inline:
            loss_fn = algorithms.inline_proximal(loss_fn, cfg.tis_cap if cfg.algo == "grpo" else 0.0)
        t1 = time.perf_counter()
        train_policy = not (cfg.algo == "ppo" and self.step_index < cfg.critic_warmup_steps)
        if train_policy:
            s = self.trainer.train(rows, loss_fn, cfg.mini_bs, cfg.gradient_accumulation_steps,
                                   epochs=cfg.ppo_epochs, entropy=cfg.entropy_coef > 0, shuffle_seed=cfg.seed)
            if inline:
                m["logprob_diff"] = s.pop("logprob_diff_total") / max(1.0, s.pop("logprob_diff_count"))
                top = float(loss_fn.fn.max_diff) if loss_fn.fn.max_diff is not None else 0.0
                m["logprob_diff_max"] = max(gather_objects(top, self.dp_group))
            m.update(_normalise(s))
        if cfg.algo == "ppo":
            m.update(self._ppo_critic_update(rows))
        m["train_s"] = time.perf_counter() - t1
        n_train = sum(len(r) for r in rows) * (cfg.ppo_epochs + (not inline))
        m["train_tok_s"] = n_train / max(1e-9, m["train_s"] + m["logprob_s"])
        if cfg.drop_rollout_state:
            self.engine.drop_rollout_state()
        return m

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

    def _single_update(self, rows) -> bool:
        """Whether this step makes exactly one optimizer update (so its forward sees the rollout-time weights)."""
        cfg = self.cfg
        return cfg.algo != "ppo" and cfg.ppo_epochs == 1 and self._updates_per_step(len(rows)) == 1

    def step_sft(self, batch) -> dict:
        cfg = self.cfg
        rows = [Row(r["_prompt_ids"], r["_response_ids"], media=self.row_media(r)) for r in batch]
        t0 = time.perf_counter()
        s = self.trainer.train(rows, algorithms.sft_loss_fn(), cfg.mini_bs, cfg.gradient_accumulation_steps)
        m = _normalise(s)
        m["train_s"] = time.perf_counter() - t0
        m["train_tok_s"] = sum(len(r) for r in rows) / max(1e-9, m["train_s"])
        return m

    def step_dpo(self, batch) -> dict:
        cfg = self.cfg
        rows = []
        for r in batch:
            media = self.row_media(r)
            rows += [Row(r["_prompt_ids"] or [self.tokenizer.eos_token_id], r["_chosen"], media=media),
                     Row(r["_prompt_ids"] or [self.tokenizer.eos_token_id], r["_rejected"], media=media)]
        for row, lp in zip(rows, self.trainer.compute_logprobs(rows, cfg.mini_bs * 2, model=self.ref)):
            row.extras["ref"] = float(sum(lp))
        t0 = time.perf_counter()
        s = self.trainer.train(rows, algorithms.dpo_loss_fn(cfg), cfg.mini_bs, cfg.gradient_accumulation_steps,
                               unit=2)
        m = _normalise(s)
        m["train_s"] = time.perf_counter() - t0
        return m

    # ---- PPO critic ----------------------------------------------------------------------------------------
    def _ppo_values(self, rows) -> dict:
        cfg = self.cfg
        with torch.no_grad():
            values = self.critic.response_values(rows, cfg.mini_bs)
        R = max(len(r.response_ids) for r in rows)
        pad = lambda xs: xs + [0.0] * (R - len(xs))  # noqa: E731
        v = torch.tensor([pad(x) for x in values])
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

    def _ppo_critic_update(self, rows) -> dict:
        cfg = self.cfg

        def fn(out, packed, norms):
            values = out.values
            return value_loss(values, packed.tok["old_values"], packed.tok["returns"], packed.mask,
                              clip=cfg.value_clip, norm=norms.num_tokens)

        s = self.critic_trainer.train(rows, fn, cfg.mini_bs, cfg.gradient_accumulation_steps, epochs=cfg.ppo_epochs)
        return {"critic_" + k: v for k, v in _normalise(s).items()}

    # ---- evaluation ----------------------------------------------------------------------------------------
    def evaluate(self, rows=None) -> float | None:
        """Greedy accuracy (mean reward) on the held-out rows (``split`` eval/test in the dataset)."""
        from areno.rl.rewards import completion_texts, record_from, score

        rows = self.eval_data if rows is None else rows
        if not rows or (self.reward_fn is None and self.agent_fn is None):
            return None
        if self.engine is None:
            self._build_engine()
        if self.agent is not None:  # an agentic task is evaluated through its agent, greedily, one sample each
            self.engine.sync()
            rewards = self.agent.collect(self.engine.share(rows), 1, self.reward_fn, greedy=True)[2]
            rewards = self.engine.gather(rewards)
            flat = [r for part in rewards for r in part]
            return sum(flat) / max(1, len(flat))
        out = self.engine.generate([self.engine_prompt(r) for r in rows], self.sampling_options(n=1, greedy=True))
        texts = completion_texts(self.tokenizer, [group[0] for group in out])
        records = [record_from(r, text, group[0].token_ids, i)
                   for i, (r, group, text) in enumerate(zip(rows, out, texts))]
        rewards, _ = score(self.reward_fn, records, timeout_s=self.cfg.reward_timeout_s or None)
        return sum(rewards) / len(rewards)

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def save(self, path=None):
        from areno.training.checkpoint import save_checkpoint

        cfg = self.cfg
        path = Path(path or Path(cfg.save_path) / f"step-{self.step_index}")
        save_checkpoint(path, model=self.model, tokenizer=self.tokenizer, optimizer=self.trainer.optimizer,
                        trainer_state={"step": self.step_index,
                                       "data": self._data_state or (self.data.state_dict() if self.data is not None
                                                                    else None),
                                       "num_updates": self.trainer.num_updates, "config": _jsonable(asdict(cfg)),
                                       "accuracy_before": self.accuracy_before, "started_at": self.started_at,
                                       "failed_reward_steps": self.failed_reward_steps},
                        rank_state={"engine_rng": self.engine.rng_state()} if self.engine is not None else None,
                        group=self.train_group)
        self.last_save = path
        return path

    def _resume(self):
        from areno.training.checkpoint import MARKER, is_complete, latest_checkpoint, load_checkpoint

        cfg = self.cfg
        if dist.is_initialized():
            dist.barrier(group=self.train_group)  # rank 0 has recovered the save folder (run_dir.claim) first
        if cfg.resume in ("latest", "auto", ""):
            path = latest_checkpoint(cfg.save_path)
            if path is None:
                raise ConfigError("--resume", f"found no complete checkpoint (a step-N folder with its {MARKER} "
                                  f"marker) in {Path(cfg.save_path).expanduser().absolute()}")
        else:
            path = Path(cfg.resume).expanduser()
            if not is_complete(path):
                why = "does not exist" if not path.exists() else f"is not a complete areno checkpoint (no {MARKER})"
                raise ConfigError("--resume", f"{path.absolute()} {why}")
        state = load_checkpoint(path, optimizer=self.trainer.optimizer,
                                rank=dist.get_rank() if dist.is_initialized() else 0)
        from areno.models import load_model

        fresh = load_model(path, dtype=self.dtype, device=self.device, tp_group=self.tp_group)
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), fresh.parameters()):
                p.copy_(q)
        del fresh
        self.step_index = state["step"]
        self.data.load_state_dict(state["data"])
        self.trainer.num_updates = state.get("num_updates", 0)
        self.accuracy_before = state.get("accuracy_before")
        self.failed_reward_steps = state.get("failed_reward_steps", 0)
        self.started_at = state.get("started_at") or self.started_at
        if self.engine is None and self.cfg.algo in RL_ALGOS:
            self._build_engine()
        if self.engine is not None:
            self.engine.policy_changed()  # split mode: the engines still hold --ckpt's weights
        engine_rng = (state.get("rank_state") or {}).get("engine_rng")
        if engine_rng is not None and self.engine is not None:
            self.engine.set_rng_state(engine_rng)
        self.logger.truncate_after(self.step_index)  # the interrupted run's lines after this checkpoint go
        log.info("resumed from %s at step %d", path, self.step_index)

    # ---- run -----------------------------------------------------------------------------------------------
    def warmup(self) -> dict:
        """``--sft-warmup-steps`` SFT steps on the rows' responses before RL (skipped when resuming past them)."""
        cfg = self.cfg
        if not cfg.sft_warmup_steps or cfg.algo not in RL_ALGOS or self.step_index > 0:
            return {}
        rows = [r for r in self.rows if r.get("response") is not None]
        if not rows:
            raise ConfigError("--sft-warmup-steps", "needs rows with a `response`")
        eos = self.tokenizer.eos_token_id
        for r in rows:
            r.setdefault("_response_ids", self._response_ids(r["response"], eos))
        from areno.training.data import PromptIterator
        from areno.training.schedule import LRSchedule

        data = iter(PromptIterator(rows, cfg.batch_size, seed=cfg.seed + 1, epochs=None))
        # the warm-up has a schedule of its own (same shape, peak --sft-warmup-lr or --lr, over its own updates) and
        # trains at temperature 1: the RL schedule and the rollout temperature apply to the RL steps only
        lr = cfg.sft_warmup_lr or cfg.lr
        rl_schedule, rl_temperature = self.trainer.schedule, self.trainer.temperature
        rl_groups = self.trainer.group_schedules
        updates = cfg.sft_warmup_steps * self._updates_per_step(cfg.batch_size)
        self.trainer.schedule = LRSchedule(lr, min_lr=min(cfg.min_lr, lr), warmup_steps=cfg.warmup_steps,
                                           total_steps=updates, style=cfg.lr_decay_style)
        self.trainer.group_schedules = multimodal.group_schedules(cfg, self.trainer.optimizer.groups, lr=lr,
                                                                  total_updates=updates)
        self.trainer.temperature = 1.0
        m = {}
        bar = None
        if self.is_main:
            from tqdm import tqdm

            bar = tqdm(total=cfg.sft_warmup_steps, desc="sft warm-up", dynamic_ncols=True)
        try:
            for i in range(cfg.sft_warmup_steps):
                m = self.step_sft(next(data))
                if self.is_main and (i + 1) % max(1, cfg.log_interval) == 0:
                    # JSON lines only: the progress bar carries the loss instead of one stdout line per step
                    self.logger.log(-(cfg.sft_warmup_steps - i - 1), {"warmup_" + k: v for k, v in m.items()},
                                    stdout=False)
                if bar is not None:
                    bar.set_postfix(loss=f"{m.get('loss', float('nan')):.3f}", refresh=False)
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            self.trainer.schedule, self.trainer.temperature = rl_schedule, rl_temperature
            self.trainer.group_schedules = rl_groups
            self.trainer.num_updates = 0  # the RL schedule starts fresh
        return m

    def run(self) -> dict:
        cfg = self.cfg
        from tqdm import tqdm

        if self.data is None:
            raise ConfigError("--dataset-path", "gives no rows to train on")
        step_fn = {"sft": self.step_sft, "dpo": self.step_dpo}.get(cfg.algo, self.step_rl)
        bar = tqdm(total=self.total_steps, initial=self.step_index, disable=not self.is_main, desc=cfg.algo,
                   dynamic_ncols=True)
        try:
            last = self._steps(step_fn, bar)
        finally:
            bar.close()  # before any error message, so the message is the last line
        if cfg.save_path and not (cfg.save_interval and self.step_index % cfg.save_interval == 0):
            self.save()
        return last

    def _steps(self, step_fn, bar) -> dict:
        cfg = self.cfg
        last = {}
        batches = iter(self.data)
        ahead = None  # async split mode: the next step's batch, already sent to the rollout engines
        read_ahead = cfg.split and cfg.max_staleness > 0 and step_fn == self.step_rl
        while self.step_index < self.total_steps:  # test first: a batch taken is a batch consumed
            batch = ahead if ahead is not None else next(batches, None)
            ahead = self._data_state = None
            if batch is None:
                break
            if read_ahead and self.step_index + 1 < self.total_steps:
                self._data_state = self.data.state_dict()  # a checkpoint after this step resumes at the next batch
                ahead = next(batches, None)
            t0 = time.perf_counter()
            m = step_fn(batch, ahead) if ahead is not None else step_fn(batch)
            self.step_index += 1
            m["step_s"] = time.perf_counter() - t0
            if torch.cuda.is_available():
                m["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if cfg.eval_interval and self.step_index % cfg.eval_interval == 0:
                acc = self.evaluate()
                if acc is not None:
                    m["eval_accuracy"] = acc
            if self.step_index % max(1, cfg.log_interval) == 0:
                self.logger.log(self.step_index, m)
            saved = bool(cfg.save_path and cfg.save_interval and self.step_index % cfg.save_interval == 0)
            if saved:
                self.save()
            bar.update(1)
            last = m
            self._check_reward_failures(m, saved)
        return last

    def _check_reward_failures(self, m: dict, saved: bool) -> None:
        """Stop (after saving) once every reward of ``--max-reward-failure-steps`` steps in a row failed."""
        cfg = self.cfg
        if "samples" not in m or not cfg.max_reward_failure_steps:
            return
        all_failed = m["samples"] > 0 and m["reward_failures"] >= m["samples"]
        self.failed_reward_steps = self.failed_reward_steps + 1 if all_failed else 0
        if self.failed_reward_steps < cfg.max_reward_failure_steps:
            return
        if cfg.save_path and not saved:
            self.save()
        n = self.failed_reward_steps
        kept = f"; the run is saved at {self.last_save} (fix the reward function, then --resume)" if cfg.save_path \
            else ""
        raise RunError(f"stopping: every reward failed in the last {n} steps (steps {self.step_index - n + 1}-"
                       f"{self.step_index}): --reward-fn-path {cfg.reward_fn_path} raised, timed out (> "
                       f"--reward-timeout-s {cfg.reward_timeout_s:g}) or returned no number on every sample (its "
                       f"first traceback is logged above){kept}")

    def close(self):
        """Release what setup() built so far (it may have stopped part-way on a bad input)."""
        if self.engine is not None:
            self.engine.close()  # split mode: the rollout ranks leave their loop
        if self.agent is not None:
            self.agent.close()
        if hasattr(self, "logger"):
            self.logger.close()
        if hasattr(self, "trainer"):
            self.trainer.optimizer.close()
        if self.critic is not None and hasattr(self, "critic_trainer"):
            self.critic_trainer.optimizer.close()
        if self.run_dir is not None:
            self.run_dir.release()
            self.run_dir = None


def _normalise(stats: dict) -> dict:
    """Turn summed stats into means: *_sum over tokens (or seqs / pairs), loss over updates."""
    out = {}
    tokens = stats.get("tokens") or stats.get("seqs") or stats.get("pairs") or 1.0
    for k, v in stats.items():
        if k.endswith("_sum"):
            denom = stats.get("pairs", tokens) if k in ("reward_margin_sum", "accuracy_sum") else tokens
            out[k[:-4]] = v / max(denom, 1e-9)
        elif k == "loss":
            out[k] = v / max(1, stats.get("num_updates", 1))
        elif k not in ("tokens", "seqs", "pairs"):
            out[k] = v
    return out


def _jsonable(d: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)) for k, v in d.items()}


def _frozen_copy(model):
    import copy

    return copy.deepcopy(model)
