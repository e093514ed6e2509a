"""The `checkpoint` section of `areno train`: saving, resuming and the reference and critic checkpoints."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.fields import ConfigError, check_non_negative, opt


@dataclass
class CheckpointSection:
    """`--help` group checkpoint."""

    save_path: Optional[str] = opt(None, "folder for checkpoints (Hugging Face layout plus training state)",
                                   "checkpoint", metavar="DIR")
    save_interval: int = opt(0, "save every N steps (0 = only at the end)", "checkpoint", needs="saved")
    save_interval_minutes: float = opt(0.0, "also save at the first step boundary N minutes after the last save (0 = "
                                       "off): a long step schedule still checkpoints often", "checkpoint",
                                       needs="saved")
    overwrite: bool = opt(False, "start a new run in a --save-path that already holds files: its checkpoints and "
                          "metrics are removed first (without it such a folder is refused unless --resume)",
                          "checkpoint", needs="saved")
    resume: Optional[str] = opt(None, "resume from a checkpoint folder, or with no value from the latest under "
                                "--save-path", "checkpoint", nargs="?", const="latest", metavar="PATH")
    ref_ckpt: Optional[str] = opt(None, "reference model for KL and DPO", "checkpoint", metavar="PATH",
                                  default_help="--ckpt", algos=("dpo", "grpo", "gspo", "ppo"), needs="reference")
    critic_ckpt: Optional[str] = opt(None, "PPO critic checkpoint", "checkpoint", metavar="PATH",
                                     default_help="a value head on a copy of --ckpt", algos=("ppo",))


    def check_checkpoint(self):
        check_non_negative("--save-interval", self.save_interval)
        check_non_negative("--save-interval-minutes", self.save_interval_minutes)
        if self.resume and self.overwrite:
            raise ConfigError("--overwrite", "and --resume contradict each other: resume continues the run in "
                              "--save-path, overwrite removes it")
        if self.resume == "latest" and not self.save_path:
            raise ConfigError("--resume", "without a folder resumes the latest checkpoint under --save-path; "
                              "set --save-path or give the checkpoint folder")
