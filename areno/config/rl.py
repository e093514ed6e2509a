"""The RL part of `areno train`'s `train` group: DPO, policy losses, KL, advantages, critic, rewards."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.constants import (
    GROUP_ALGOS,
    KL_ESTIMATORS,
    LOSS_AGGS,
    OFF_POLICY_CORRECTIONS,
    RL_ALGOS,
    TOKEN_CLIP_ALGOS,
)
from areno.config.fields import ConfigError, check_choice, check_non_negative, check_range, check_sizes, flag_name, opt


@dataclass
class RLSection:
    """`--help` group train, second part."""

    ppo_epochs: int = opt(1, "optimizer passes over each rollout batch", "train", algos=RL_ALGOS)
    dpo_beta: float = opt(0.1, "DPO inverse temperature", "train", algos=("dpo",))
    dpo_label_smoothing: float = opt(0.0, "DPO label smoothing (conservative DPO), in [0, 0.5)", "train",
                                       algos=("dpo",))
    clip_eps_low: float = opt(0.2, "lower clip of the token importance ratio: 1 - eps", "train",
                               algos=TOKEN_CLIP_ALGOS)
    clip_eps_high: float = opt(0.28, "upper clip of the token importance ratio: 1 + eps", "train",
                                algos=TOKEN_CLIP_ALGOS)
    gspo_clip_eps: float = opt(3e-4, "GSPO sequence-level ratio clip", "train", algos=("gspo",))
    kl_coef: float = opt(0.0, "KL penalty to the reference policy (0 = no reference model)", "train",
                           algos=RL_ALGOS)
    kl_estimator: str = opt("k3", "KL estimator", "train", choices=KL_ESTIMATORS, algos=RL_ALGOS,
                            needs="kl")
    entropy_coef: float = opt(0.0, "entropy bonus", "train", algos=TOKEN_CLIP_ALGOS)
    advantage_std_norm: bool = opt(True, "divide group advantages by the group reward std", "train",
                                   algos=GROUP_ALGOS)
    off_policy_correction: str = opt(
        "tis", "correction of the rollout/trainer mismatch (r_t = trainer / rollout probability of a sampled token):"
        + "".join(f"\n{k}: {v}" for k, v in OFF_POLICY_CORRECTIONS.items()) + "\n", "train",
        choices=tuple(OFF_POLICY_CORRECTIONS), algos=RL_ALGOS, needs="correction")
    tis_cap: float = opt(2.0, "truncated importance sampling cap on rollout/trainer mismatch (0 = off)", "train",
                          algos=RL_ALGOS, needs="tis")
    is_mask_low: float = opt(0.5, "lower ratio bound of --off-policy-correction mask and icepop", "train",
                             algos=TOKEN_CLIP_ALGOS, needs="is_mask")
    is_mask_high: float = opt(2.0, "upper ratio bound of --off-policy-correction mask and icepop", "train",
                              algos=TOKEN_CLIP_ALGOS, needs="is_mask")
    loss_agg: str = opt("token-mean", "how token losses are aggregated over the global batch", "train",
                        choices=LOSS_AGGS, algos=TOKEN_CLIP_ALGOS)
    filter_zero_variance_groups: bool = opt(False, "drop groups whose rewards are all equal", "train",
                                              algos=GROUP_ALGOS)
    critic_lr: Optional[float] = opt(None, "PPO critic learning rate", "train", default_help="--lr",
                                     algos=("ppo",))
    gamma: float = opt(1.0, "PPO discount", "train", algos=("ppo",))
    gae_lambda: float = opt(0.95, "PPO GAE lambda", "train", algos=("ppo",))
    value_clip: float = opt(0.2, "PPO value-loss clip (0 = off)", "train", algos=("ppo",))
    dual_clip: float = opt(3.0, "PPO dual-clip constant c > 1 for negative advantages (0 = off)", "train",
                           algos=("ppo",), needs="surrogate")
    critic_warmup_steps: int = opt(0, "PPO steps that train only the critic", "train", algos=("ppo",))
    sft_warmup_steps: int = opt(0, "SFT steps on the rows' `response` before RL starts", "train",
                                 algos=RL_ALGOS)
    sft_warmup_lr: float = opt(0.0, "peak learning rate of the SFT warm-up steps (0 = --lr); the RL schedule starts "
                               "fresh after them", "train", algos=RL_ALGOS, needs="warmup")
    reward_timeout_s: float = opt(60.0, "seconds one reward_fn call may run before its sample is scored 0.0 as a "
                                  "failure (0 = no limit)", "train", needs="rollout")
    max_reward_failure_steps: int = opt(3, "stop the run (exit 1, after saving) once every reward of this many steps "
                                        "in a row failed (0 = never)", "train", algos=RL_ALGOS)

    def check_rl(self):
        check_sizes(self, ("ppo_epochs",))
        for name, choices in (("kl_estimator", KL_ESTIMATORS), ("loss_agg", LOSS_AGGS),
                              ("off_policy_correction", tuple(OFF_POLICY_CORRECTIONS))):
            check_choice(flag_name(name), getattr(self, name), choices, optional=True)
        for name in ("critic_warmup_steps", "sft_warmup_steps", "sft_warmup_lr", "kl_coef", "entropy_coef", "tis_cap",
                     "value_clip", "clip_eps_high", "reward_timeout_s", "max_reward_failure_steps"):
            check_non_negative(flag_name(name), getattr(self, name))
        if self.critic_lr is not None:
            check_non_negative("--critic-lr", self.critic_lr)
        check_range("--clip-eps-low", self.clip_eps_low, 0.0, 1.0, high_open=True)
        if getattr(self, "algo", None) == "gspo" and self.off_policy_correction in ("mask", "icepop", "cispo"):
            raise ConfigError("--off-policy-correction", f"{self.off_policy_correction} is not built for --algo gspo "
                              "(its ratio is sequence-level): use seq-tis")
        check_non_negative("--is-mask-low", self.is_mask_low)
        if not self.is_mask_high > self.is_mask_low:
            raise ConfigError("--is-mask-high",
                              f"must be > --is-mask-low ({self.is_mask_low}), got {self.is_mask_high}")
        check_range("--gspo-clip-eps", self.gspo_clip_eps, 0.0, 1.0, low_open=True)
        if not self.dpo_beta > 0:
            raise ConfigError("--dpo-beta", f"must be > 0, got {self.dpo_beta}")
        check_range("--dpo-label-smoothing", self.dpo_label_smoothing, 0.0, 0.5, high_open=True)
        check_range("--gamma", self.gamma, 0.0, 1.0)
        check_range("--gae-lambda", self.gae_lambda, 0.0, 1.0)
        if self.dual_clip != 0 and not self.dual_clip > 1:
            raise ConfigError("--dual-clip", f"must be > 1 (or 0 to turn it off), got {self.dual_clip}")
