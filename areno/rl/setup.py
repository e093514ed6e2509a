"""The set-up of a training run: user files, process groups, the policy, reference and critic, their trainers.

Each function takes the inputs it needs and returns what it built; ``TrainLoop.setup`` calls them in order (user
files first, so a bad plugin fails before any GPU work).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from areno.config import ConfigError
from areno.distributed.collectives import group_rank, group_size
from areno.rl.algorithms import ALGORITHMS, updates_per_step
from areno.training import lora, multimodal
from areno.training.trainer import PolicyTrainer

log = logging.getLogger("areno.train")


@dataclass
class UserInputs:
    reward_fn: object  # --reward-fn-path's function, or None
    agent_fn: object  # --agent-fn's run_agent, or None
    rows: list  # (dataset index, row) of the training rows
    eval_rows: list  # (dataset index, row) of the held-out rows (``split`` eval/test)


def load_user_inputs(cfg, *, sdk: bool) -> UserInputs:
    """The reward and agent functions and the dataset rows, checked for ``cfg.algo``."""
    from areno.training.data import check_rows, load_rows
    from areno.training.plugins import load_agent, load_dataset_loader, load_reward_fn

    if not sdk:
        cfg.require_run_inputs()
    reward_fn = load_reward_fn(cfg.reward_fn_path) if cfg.reward_fn_path else None
    agent_fn = load_agent(cfg.agent_fn) if cfg.agent_fn else None
    loader = load_dataset_loader(cfg.dataset_loader_fn) if cfg.dataset_loader_fn else None
    rows = load_rows(cfg.dataset_path, loader_fn=loader) if (cfg.dataset_path or loader) else []
    indexed = list(enumerate(rows))  # the dataset row index, named by errors (and the media cache's key)
    held_out = [(i, r) for i, r in indexed if r.get("split") in ("eval", "test")]
    train = [(i, r) for i, r in indexed if r.get("split") not in ("eval", "test")]
    if train or not sdk:
        check_rows([r for _, r in train], cfg.algo)
    return UserInputs(reward_fn, agent_fn, train, held_out)


@dataclass
class Groups:
    """This rank's process groups (None: no such group) and where it stands in them."""

    layout: object  # split mode's parallel.SplitLayout
    tp_group: object
    dp_group: object
    dp_rank: int
    dp_size: int
    is_main: bool
    train_group: object  # split mode: the train ranks; None: the whole world


def init_groups(cfg) -> Groups:
    """Pin this rank's GPU (--train-devices) and make the run's process groups."""
    from areno.distributed import parallel

    device = parallel.rank_device(cfg.train_devices, parallel.env_rank()) if cfg.train_devices \
        else None  # on a CPU host the indices name process slots, so the flag changes nothing there
    if device is not None:
        torch.cuda.set_device(device)
    layout = None
    if cfg.split:
        layout = parallel.init_split(cfg.world_size, cfg.tp_size, cfg.rollout_tp, device=device)
    elif cfg.world_size > 1:
        parallel.init_distributed(tp_size=cfg.tp_size, device=device)
    tp_group = parallel.get_tp_group() if cfg.tp_size > 1 else None
    dp_group = parallel.get_dp_group() if cfg.world_size // cfg.tp_size > 1 else None
    return Groups(layout, tp_group, dp_group, group_rank(dp_group), group_size(dp_group), parallel.is_main_process(),
                  layout.train_group if layout is not None else None)


def load_policy(cfg, device, dtype, tp_group, *, model=None, tokenizer=None):
    """The policy (in train mode, frozen parts frozen) and its tokenizer; ``model``/``tokenizer``: the SDK's own."""
    from areno.models import load_tokenizer

    with checkpoint_flag("--ckpt", cfg.ckpt):  # QLoRA: the base quantised as it loads (lora.load_base)
        model = model or lora.load_base(cfg, dtype=dtype, device=device, tp_group=tp_group,
                                        attn_backend=cfg.attn_backend)
        tok = tokenizer or load_tokenizer(cfg.ckpt)
    multimodal.check_flags(cfg, model)
    multimodal.freeze(model, cfg)  # the tower and projector stay frozen (and in eval mode) unless unfrozen
    model.train()
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    lora.apply(cfg, model)  # --lora-rank: the base frozen, the adapter hooked in (rollout applies it too)
    return model, tok


@contextmanager
def checkpoint_flag(flag: str, value):
    """A checkpoint that cannot be loaded (a missing folder, an unresolvable hub id, a config.json that is not JSON
    or names an unknown architecture, weights cut short or made for another config) as one ``ConfigError`` line
    naming ``flag``, not a traceback."""
    try:
        yield
    except ConfigError:  # already names its flag
        raise
    except (OSError, KeyError, ValueError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() quotes its message
        raise ConfigError(flag, f"{str(value)!r} cannot be loaded: {why}") from e


def check_context(cfg, model, inputs: UserInputs) -> int:
    """The model's context (``max_position_embeddings``: the most tokens one sequence may hold), checked at start
    against what the run will ask of it: a rollout's --max-prompt-tokens + --max-new-tokens and an agent's
    --max-context-len must fit, or the run stops here with one line instead of an IndexError mid-run."""
    context = int(model.config.max_position_embeddings)
    samples = ALGORITHMS[cfg.algo].needs_reward or cfg.split or bool(
        inputs.eval_rows and (inputs.reward_fn or inputs.agent_fn))  # held-out accuracy is sampled too
    where = f"the model's context ({context} tokens: max_position_embeddings of {cfg.ckpt or 'the model'})"
    need = cfg.max_prompt_tokens + cfg.max_new_tokens
    if samples and need > context:
        raise ConfigError("--max-new-tokens", f"{cfg.max_new_tokens} + --max-prompt-tokens {cfg.max_prompt_tokens} "
                                              f"= {need} tokens is more than {where}; lower one of them")
    if samples and inputs.agent_fn and cfg.max_context_len and cfg.max_context_len > context:
        raise ConfigError("--max-context-len", f"{cfg.max_context_len} is more than {where}")
    return context


def load_ref(cfg, policy, device, dtype, tp_group):
    """The frozen reference: --ref-ckpt, else (LoRA) the policy with its adapter off, else --ckpt, else a copy of the
    policy (an SDK model)."""
    import copy

    from areno.models import load_model

    base = lora.reference(cfg, policy)
    if base is not None:  # LoRA: the base with the adapter off, no second copy of the weights
        return base
    if cfg.ref_ckpt or cfg.ckpt:
        with checkpoint_flag("--ref-ckpt" if cfg.ref_ckpt else "--ckpt", cfg.ref_ckpt or cfg.ckpt):
            ref = load_model(cfg.ref_ckpt or cfg.ckpt, dtype=dtype, device=device, tp_group=tp_group,
                             attn_backend=cfg.attn_backend)
    else:
        ref = copy.deepcopy(policy)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def logprob_temperature(cfg) -> float:
    """The temperature the trainer's log-probs are taken at: the rollout's for RL, else 1."""
    t = cfg.temperature
    return t if t and t > 0 and ALGORITHMS[cfg.algo].needs_reward else 1.0


def make_trainer(cfg, model, lr, total, groups: Groups) -> PolicyTrainer:
    """``model``'s optimizer, schedules (over ``total`` steps' updates) and trainer."""
    from areno.training.optimizer import MasterAdamW
    from areno.training.schedule import LRSchedule

    def make_optimizer(params):
        return MasterAdamW(params, lr=lr, weight_decay=cfg.weight_decay, dp_group=groups.dp_group,
                           tp_group=groups.tp_group, offload=cfg.optimizer_state_offload,
                           offload_dir=cfg.optimizer_state_offload_dir,
                           offload_batch_size=cfg.optimizer_state_offload_batch_size, states=cfg.optimizer_states)

    # frozen parts have no optimizer state (LoRA: only the adapter's parameters have one)
    opt = make_optimizer(lora.optimizer_params(model) or multimodal.optimizer_params(model))
    mtp = cfg.mtp_loss_weight > 0 and not model.is_value_model  # the policy's MTP draft trains beside it
    rl = ALGORITHMS[cfg.algo].needs_reward
    updates = updates_per_step(cfg, cfg.batch_size * (cfg.n_samples if rl else 1), groups.dp_size) * max(
        1, cfg.ppo_epochs if rl else 1)
    sched = LRSchedule(lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=total * updates,
                       style=cfg.lr_decay_style)
    # the trainer refuses a rate for a model without a selection bias
    bias_rate = 0.0 if model.is_value_model else cfg.router_bias_update_rate
    group_schedules = multimodal.group_schedules(cfg, opt.groups, lr=lr, total_updates=total * updates)
    # the critic: eager; LoRA: eager (the adapter's update is not graphed; --train-cuda-graphs on is refused)
    # and the MTP draft's training (its loss reads the eager forward's hidden states)
    graphs = "off" if model.is_value_model or lora.optimizer_params(model) or mtp else cfg.train_cuda_graphs
    if graphs == "auto" and rl and not cfg.split:
        # colocated RL: eager. Measured at G1 on one H200 (bench/grpo_step.py --impls areno --steps 5
        # --train-cuda-graphs off,on,on,off): the graphed update is slower there (1.41 s vs 1.27 s; step 3.57 s vs
        # 3.44 s): its large microbatches are compute-bound, bucket padding costs more than launch gaps save, and a
        # new shape bucket is captured mid-run. Peak allocated memory was the same both ways there, but the graphed
        # step's pool stays reserved between updates (1.15-1.67x the eager step's reservation, tests/training/
        # test_train_graphs_gpu.py), memory the rollout's KV cache then lacks. `on` still graphs it.
        graphs = "off"
    trainer = PolicyTrainer(model, opt, sched, temperature=logprob_temperature(cfg), grad_clip=cfg.grad_clip,
                            dp_group=groups.dp_group, tp_group=groups.tp_group, router_bias_update_rate=bias_rate,
                            group_schedules=group_schedules, train_cuda_graphs=graphs)
    if mtp:
        from areno.training.mtp import MTPTrainer

        trainer.mtp = MTPTrainer(model, cfg.mtp_loss_weight, make_optimizer)
    return trainer


def make_critic_trainer(cfg, policy, total, device, dtype, groups: Groups) -> PolicyTrainer:
    """PPO's value model (--critic-ckpt, else the policy's checkpoint with a value head) and its trainer."""
    from areno.rl.critic import ValueModel

    with checkpoint_flag("--critic-ckpt" if cfg.critic_ckpt else "--ckpt", cfg.critic_ckpt or cfg.ckpt):
        critic = ValueModel.from_policy(cfg.critic_ckpt or cfg.ckpt, policy, dtype=dtype, device=device,
                                        tp_group=groups.tp_group)
    multimodal.freeze(critic, cfg)
    critic.backbone.set_activation_checkpointing(cfg.activation_checkpointing)
    return make_trainer(cfg, critic, cfg.critic_lr or cfg.lr, total, groups)


def make_logger(cfg, is_main: bool):
    """The metrics logger; rank 0 also writes the whole resolved configuration beside metrics.jsonl."""
    import json
    from dataclasses import asdict

    from areno.training.metrics import MetricsLogger

    logger = MetricsLogger(cfg.metrics_folder, tensorboard=cfg.tensorboard, rank=0 if is_main else 1)
    if is_main:  # the whole resolved configuration lives with the run (stdout shows it with --verbose)
        (logger.metrics_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str) + "\n")
    if is_main and cfg.wandb_project:
        from areno.training.wandb_log import WandbRun

        logger.wandb = WandbRun(cfg, logger.metrics_dir)
    return logger


def warn_penalised_rollout(cfg) -> None:
    """One-line hints on a rollout that samples from another distribution than the trainer's."""
    if cfg.rollout_dtype == "fp8" and cfg.off_policy_correction in ("tis", "seq-tis") and not cfg.tis_cap > 0:
        log.warning("hint: --rollout-dtype fp8 samples from a slightly different policy than the bf16 trainer's; "
                    "pair it with --off-policy-correction tis (and --tis-cap > 0) to correct for it")
    if cfg.repetition_penalty != 1.0 or cfg.presence_penalty or cfg.frequency_penalty:
        log.warning("rollout with --repetition-penalty/--presence-penalty/--frequency-penalty: the rollout "
                    "log-probs are those of the penalised distribution the tokens were drawn from, the trainer's "
                    "those of the plain policy, so logprob_diff includes the penalty and --tis-cap's importance "
                    "weights correct for it as off-policy sampling")
