"""The `observability` section of `areno train`: metrics, logging, evaluation, rollout dumps and progress."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

import os
from dataclasses import dataclass
from typing import Optional

from areno.config.constants import RL_ALGOS, WANDB_MODES
from areno.config.evaluate import DATASET_HELP, PROMPT_FORMAT_HELP, PROMPT_FORMATS, check_prompt_options, dataset_specs
from areno.config.fields import ConfigError, check_choice, check_non_negative, check_number, check_sizes, opt


@dataclass
class ObservabilitySection:
    """`--help` group observability."""

    metrics_dir: Optional[str] = opt(None, "folder for metrics JSON lines and TensorBoard events", "observability",
                                     metavar="DIR", default_help="<save-path>/metrics, else a new "
                                     "./runs/<date>-<time>-<pid> per run; runs/latest links the newest")
    log_interval: int = opt(1, "print a metrics line every N steps", "observability")
    verbose: bool = opt(False, "also print the resolved configuration to stdout (it is always written to "
                        "config.json in the metrics folder)", "observability")
    eval_interval: int = opt(0, "evaluate held-out prompts and the --eval-dataset-path sets every N steps (0 = off)",
                             "observability", needs="rollout")
    eval_dataset_path: Optional[list[str]] = opt(
        None, DATASET_HELP + "; --eval-n-samples samples per prompt scored by --reward-fn-path (avg@K, pass@k, maj@K "
        "with 95% intervals as eval/<name>/...) before training, every --eval-interval steps and after the last",
        "observability", action="append", type=str, metavar="NAME=FILE", needs="rollout")
    eval_n_samples: int = opt(4, "samples per prompt of the --eval-dataset-path sets (K)", "observability",
                              needs="evalsets")
    eval_temperature: float = opt(1.0, "sampling temperature of the --eval-dataset-path sets (0 = greedy; the "
                                  "other sampling settings are the rollout's)", "observability", needs="evalsets")
    eval_before_training: bool = opt(True, "evaluate the --eval-dataset-path sets before the first step (step 0)",
                                     "observability", needs="evalsets")
    eval_prompt_field: str = opt("prompt", "the --eval-dataset-path rows' prompt field", "observability",
                                 needs="evalsets")
    eval_answer_field: str = opt("answer", "the --eval-dataset-path rows' reference-answer field", "observability",
                                 needs="evalsets")
    eval_prompt_format: str = opt("auto", PROMPT_FORMAT_HELP + " (the --eval-dataset-path sets)", "observability",
                                  choices=PROMPT_FORMATS, needs="evalsets")
    eval_system_prompt: Optional[str] = opt(None, "a system message put before every --eval-dataset-path chat prompt",
                                            "observability", metavar="TEXT", needs="evalsets")
    tensorboard: bool = opt(True, "write TensorBoard events beside the JSON lines", "observability")
    wandb_project: Optional[str] = opt(None, "also log to this Weights & Biases project: every metric, the resolved "
                                       "configuration, the reward-curve picture and evaluation sample tables (needs "
                                       "pip install wandb)", "observability", metavar="NAME")
    wandb_run_name: Optional[str] = opt(None, "the W&B run's name", "observability", metavar="NAME", needs="wandb",
                                        default_help="W&B's generated name")
    wandb_mode: str = opt("online", "online: stream to W&B (log in first: wandb login); offline: write the run "
                          "under <metrics folder>/wandb for a later `wandb sync`", "observability",
                          choices=WANDB_MODES, needs="wandb")
    rollout_dump_dir: Optional[str] = opt(
        None, "write every RL step's rows as JSON lines (token ids, loss mask, rollout log-probs, policy version, "
        "reward, finish reason; an agent's messages) to DIR/step-N.jsonl", "observability", metavar="DIR",
        algos=RL_ALGOS)
    decode_progress_interval_s: float = opt(0.0, "report decode throughput every N seconds (0 = off)",
                                            "observability", needs="rollout")

    @property
    def metrics_folder(self) -> str:
        """Where metrics.jsonl, TensorBoard events and config.json go."""
        return self.metrics_dir or (os.path.join(self.save_path, "metrics") if self.save_path else "runs/latest")

    @property
    def eval_sets(self) -> list[tuple[str, str]]:
        """--eval-dataset-path as (name, path) pairs."""
        return dataset_specs("--eval-dataset-path", self.eval_dataset_path)

    def check_observability(self):
        check_sizes(self, ("log_interval",))
        check_non_negative("--eval-interval", self.eval_interval)
        self.check_eval_sets()
        check_choice("--wandb-mode", self.wandb_mode, WANDB_MODES)
        if self.wandb_project is not None and not self.wandb_project.strip():
            raise ConfigError("--wandb-project", "must not be empty")
        check_non_negative("--decode-progress-interval-s", self.decode_progress_interval_s)

    def check_eval_sets(self):
        if isinstance(self.eval_dataset_path, str):
            self.eval_dataset_path = [self.eval_dataset_path]
        sets = self.eval_sets  # each NAME=FILE checked
        check_sizes(self, ("eval_n_samples",))
        check_number("--eval-temperature", self.eval_temperature)
        if self.eval_temperature < 0:
            raise ConfigError("--eval-temperature", f"must be >= 0, got {self.eval_temperature!r}")
        check_prompt_options(self, "--eval-")
        if not sets:
            return
        if not self.reward_fn_path:
            raise ConfigError("--eval-dataset-path", "needs --reward-fn-path (it scores the samples)")
        if self.rollout_devices is not None and self.partial_rollout:
            raise ConfigError("--eval-dataset-path", "is not built with --partial-rollout yet (an evaluation on the "
                              "rollout ranks would decode the sequences kept in flight there); evaluate the saved "
                              "checkpoints with `areno eval`")
        if self.rollout_devices is not None and self.agent_fn:
            raise ConfigError("--eval-dataset-path", "is not built for agentic rollout in split mode yet (--agent-fn "
                              "with --rollout-devices); evaluate the saved checkpoints with `areno eval`")
