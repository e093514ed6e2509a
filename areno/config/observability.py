"""The `observability` section of `areno train`: metrics, logging, evaluation, rollout dumps and progress."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

import os
from dataclasses import dataclass
from typing import Optional

from areno.config.constants import RL_ALGOS
from areno.config.fields import check_non_negative, check_sizes, opt


@dataclass
class ObservabilitySection:
    """`--help` group observability."""

    metrics_dir: Optional[str] = opt(None, "folder for metrics JSON lines and TensorBoard events", "observability",
                                     metavar="DIR", default_help="<save-path>/metrics, else a new "
                                     "./runs/<date>-<time>-<pid> per run; runs/latest links the newest")
    log_interval: int = opt(1, "print a metrics line every N steps", "observability")
    verbose: bool = opt(False, "also print the resolved configuration to stdout (it is always written to "
                        "config.json in the metrics folder)", "observability")
    eval_interval: int = opt(0, "evaluate held-out prompts every N steps (0 = off)", "observability",
                            needs="rollout")
    tensorboard: bool = opt(True, "write TensorBoard events beside the JSON lines", "observability")
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

    def check_observability(self):
        check_sizes(self, ("log_interval",))
        check_non_negative("--eval-interval", self.eval_interval)
        check_non_negative("--decode-progress-interval-s", self.decode_progress_interval_s)
