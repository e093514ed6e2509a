"""The `basic` section of `areno train`: what to run (model, data, plugins, algorithm) and on how many ranks."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.constants import ALGOS, DTYPES, RL_ALGOS
from areno.config.fields import ConfigError, check_choice, check_file, check_sizes, opt


@dataclass
class BasicSection:
    """`--help` group basic."""

    preset: Optional[str] = opt(None, "start from a named preset config; flags given explicitly override it", "basic",
                                metavar="NAME")
    ckpt: Optional[str] = opt(None, "policy checkpoint: a Hugging Face repo id or a local folder (required)", "basic",
                                metavar="PATH")
    dataset_path: Optional[str] = opt(
        None, "local json/jsonl/parquet/csv file, a `datasets` folder, or a hub reference name[:config[:split]] "
        "such as gsm8k:main", "basic", metavar="PATH")
    dataset_loader_fn: Optional[str] = opt(
        None, "Python file defining load_training_dataset(path, *, default_loader, **kwargs)", "basic", metavar="FILE")
    reward_fn_path: Optional[str] = opt(
        None, "Python file defining reward_fn(record) -> float (required for grpo, gspo and ppo)", "basic",
        metavar="FILE")
    agent_fn: Optional[str] = opt(
        None, "Python file defining async run_agent(ctx, batch): multi-turn agentic rollout (grpo, gspo)", "basic",
        metavar="FILE")
    algo: str = opt("grpo", "training algorithm", "basic", choices=ALGOS)
    world_size: int = opt(1, "total training ranks (one process per GPU); with --train-devices, its length", "basic")
    tp_size: int = opt(1, "training tensor-parallel size; --world-size must be divisible by it", "basic")
    batch_size: int = opt(8, "prompts per step (the logical rollout batch)", "basic")
    n_samples: int = opt(8, "completions sampled per prompt", "basic")
    seed: int = opt(0, "random seed (data order, sampling, initialisation)", "basic")
    dtype: Optional[str] = opt(None, "parameter/compute dtype", "basic", choices=DTYPES,
                               default_help="bfloat16 on GPU; float32 on a CPU without bfloat16 support")

    def check_basic(self):
        if not self.ckpt:
            raise ConfigError("--ckpt", "is required (a Hugging Face repo id or a local checkpoint folder)")
        check_file("--dataset-loader-fn", self.dataset_loader_fn)
        check_file("--reward-fn-path", self.reward_fn_path)
        check_file("--agent-fn", self.agent_fn)
        check_sizes(self, ("world_size", "tp_size", "batch_size", "n_samples"))
        if self.world_size % self.tp_size:
            raise ConfigError("--world-size", f"{self.world_size} is not divisible by --tp-size {self.tp_size}")
        check_choice("--algo", self.algo, ALGOS)
        check_choice("--dtype", self.dtype, DTYPES, optional=True)

    def require_run_inputs(self):
        """What a whole `areno train` run needs beyond the model (the SDK may pass its batches itself)."""
        if not self.dataset_path and not self.dataset_loader_fn:
            raise ConfigError("--dataset-path", "is required (unless --dataset-loader-fn builds the data itself)")
        if self.algo in RL_ALGOS and not self.reward_fn_path and not self.agent_fn:
            raise ConfigError("--reward-fn-path", f"is required for --algo {self.algo} (unless --agent-fn returns "
                              "the rewards)")
