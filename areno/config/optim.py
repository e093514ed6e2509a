"""The optimisation part of `areno train`'s `train` group: batch shape, schedule, MoE balancing, CUDA graphs."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.constants import LR_STYLES, RL_ALGOS, ROUTING_REPLAY, TRAIN_CUDA_GRAPHS
from areno.config.fields import ConfigError, check_choice, check_non_negative, check_range, check_sizes, flag_name, opt


@dataclass
class OptimSection:
    """`--help` group train, first part (its checks read the basic and memory sections)."""

    mini_bs: int = opt(1, "training rows in one gradient microbatch", "train")
    gradient_accumulation_steps: int = opt(1, "microbatches that contribute to one optimizer update", "train")
    lr: float = opt(1e-6, "peak learning rate", "train")
    min_lr: float = opt(0.0, "final learning rate of the decay", "train")
    lr_decay_style: str = opt("constant", "learning-rate schedule after warm-up", "train", choices=LR_STYLES)
    warmup_steps: int = opt(0, "linear warm-up steps", "train")
    weight_decay: float = opt(0.0, "AdamW weight decay", "train")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 = off)", "train")
    router_bias_update_rate: float = opt(
        0.0, "MoE selection-bias step per optimizer step (auxiliary-loss-free balancing: bias += rate * "
        "sign(mean load - expert load), loads summed over data-parallel ranks; models with a selection bias such as "
        "Ling 3; 0 = off)", "train")
    routing_replay: str = opt(
        "auto", "routing replay: the training forward uses the experts the rollout chose for each token (per MoE "
        "layer; weights from the current router). auto = on for grpo/gspo/ppo with a sparse-MoE policy; on = "
        "required (refused for a dense policy or a non-RL --algo); off", "train", choices=ROUTING_REPLAY,
        algos=RL_ALGOS)
    train_cuda_graphs: str = opt(
        "auto", "replay each text microbatch's forward/backward and the optimizer step as CUDA graphs per shape "
        "bucket (no Python launch gaps). auto = on for a dense text policy on CUDA without activation checkpointing, "
        "TP or routing replay, outside colocated RL (eager there: measured slower at G1, whose large microbatches "
        "are compute-bound; other policies and the PPO critic are eager too); on = required (refused where it cannot "
        "apply); off", "train", choices=TRAIN_CUDA_GRAPHS)
    max_steps: Optional[int] = opt(None, "stop after this many steps", "train", default_help="--epochs over the data")
    epochs: int = opt(1, "passes over the dataset", "train", needs="epochs")

    def check_optim(self):
        check_sizes(self, ("mini_bs", "gradient_accumulation_steps", "max_steps", "epochs"))
        for name, choices in (("lr_decay_style", LR_STYLES), ("train_cuda_graphs", TRAIN_CUDA_GRAPHS)):
            check_choice(flag_name(name), getattr(self, name), choices, optional=True)
        if self.train_cuda_graphs == "on" and self.activation_checkpointing:
            raise ConfigError("--train-cuda-graphs", "on needs --no-activation-checkpointing (recomputation in the "
                              "backward is not graphed)")
        if self.train_cuda_graphs == "on" and self.tp_size > 1:
            raise ConfigError("--train-cuda-graphs", "on does not apply with --tp-size > 1 (TP is not graphed)")
        if self.routing_replay == "on" and self.algo not in RL_ALGOS:
            raise ConfigError("--routing-replay", f"on applies to RL with rollout (grpo, gspo, ppo), not --algo "
                              f"{self.algo}")
        if not self.lr > 0:
            raise ConfigError("--lr", f"must be > 0, got {self.lr}")
        check_range("--min-lr", self.min_lr, 0.0, self.lr)
        for name in ("warmup_steps", "weight_decay", "grad_clip", "router_bias_update_rate"):
            check_non_negative(flag_name(name), getattr(self, name))
