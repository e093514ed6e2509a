"""`EvalConfig`: the flags of `areno eval` (K samples per prompt on areno's engine, pass@k / maj@K with intervals),
and the dataset flags `areno eval` and `areno train --eval-dataset-path` share (``name=FILE`` specs, field names)."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from areno.config.constants import DTYPES
from areno.config.fields import ConfigError, check_choice, check_file, check_int, check_sizes, opt
from areno.config.sampling import check_sampling

PROMPT_FORMATS = ("auto", "chat", "plain")
DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DATASET_HELP = ("an evaluation set: NAME=FILE (or just FILE: named by its file name), FILE a jsonl/json/parquet/csv "
                "file or a `datasets` save_to_disk folder; repeat the flag for several")
PROMPT_FORMAT_HELP = ("auto: a chat-message prompt goes through the chat template, a string prompt as it is; chat: "
                      "a string prompt becomes one user message (through the chat template); plain: string prompts "
                      "as they are")


def dataset_specs(flag: str, specs) -> list[tuple[str, str]]:
    """``["math500=data/math500.jsonl", "aime.parquet"]`` -> ``[("math500", ...), ("aime", "aime.parquet")]``:
    names unique and plain (they name metrics: eval/<name>/pass@k), every file there."""
    out: list[tuple[str, str]] = []
    for spec in specs or ():
        name, sep, path = str(spec).partition("=")
        if not sep:
            path = name
            name = Path(path.rstrip("/")).name.split(".")[0]
        name, path = name.strip(), path.strip()
        if not DATASET_NAME.match(name):
            raise ConfigError(flag, f"{spec!r}: the name {name!r} must be letters, digits, '_', '.' or '-' "
                                    "(it names the metrics: eval/<name>/avg@K)")
        if not path or not Path(path).expanduser().exists():
            raise ConfigError(flag, f"{spec!r}: file or folder not found: {path or '(empty)'}")
        if name in (n for n, _ in out):
            raise ConfigError(flag, f"names the dataset {name!r} twice (give each NAME=FILE a different name)")
        out.append((name, path))
    return out


def check_prompt_options(config, flag_prefix: str = "--") -> None:
    """The checks of --prompt-field / --answer-field / --prompt-format / --system-prompt (``--eval-``: the
    ``eval_``-prefixed fields of areno train)."""
    attr = flag_prefix[2:].replace("-", "_")
    for name in ("prompt_field", "answer_field"):
        if not getattr(config, attr + name):
            raise ConfigError(f"{flag_prefix}{name.replace('_', '-')}", "must not be empty")
    check_choice(f"{flag_prefix}prompt-format", getattr(config, attr + "prompt_format"), PROMPT_FORMATS)
    if getattr(config, attr + "system_prompt") and getattr(config, attr + "prompt_format") == "plain":
        raise ConfigError(f"{flag_prefix}system-prompt", "needs chat prompts (--prompt-format auto or chat): a plain "
                                                         "prompt has no system message")


@dataclass
class EvalConfig:
    """`areno eval`: K samples per prompt of each dataset on areno's engine; avg@K, pass@k, maj@K, 95% intervals."""

    model_path: Optional[str] = opt(None, "model: a Hugging Face repo id or a local folder (required)", "basic",
                                    metavar="PATH")
    dataset_path: Optional[list[str]] = opt(None, DATASET_HELP + " (required)", "basic", action="append", type=str,
                                            metavar="NAME=FILE")
    reward_fn_path: Optional[str] = opt(
        None, "Python file defining reward_fn(record) -> float (a sample is correct when it scores > 0.5) and "
        "optionally extract_answer(completion) -> str | None, the answer maj@K votes on (default: the stripped "
        "completion) (required)", "basic", metavar="FILE")
    lora_path: Optional[str] = opt(None, "evaluate the model with this PEFT LoRA adapter folder (adapter_config.json "
                                   "+ adapter_model.safetensors) on it, unmerged", "basic", metavar="DIR")
    seed: int = opt(0, "seed of the engine's sampling and of the bootstrap", "basic")
    dtype: Optional[str] = opt(None, "parameter/compute dtype", "basic", choices=DTYPES,
                               default_help="bfloat16 on GPU; float32 on a CPU")
    prompt_field: str = opt("prompt", "the row field holding the prompt (a string or chat messages)", "basic")
    answer_field: str = opt("answer", "the row field holding the reference answer (the reward's record.answer)",
                            "basic")
    prompt_format: str = opt("auto", PROMPT_FORMAT_HELP, "basic", choices=PROMPT_FORMATS)
    system_prompt: Optional[str] = opt(None, "a system message put before every chat prompt that has none (with "
                                       "--prompt-format auto a string prompt then becomes a chat one)", "basic",
                                       metavar="TEXT")
    n_samples: int = opt(8, "completions sampled per prompt (K of avg@K, pass@k, maj@K)", "rollout")
    temperature: float = opt(1.0, "sampling temperature (0 = greedy)", "rollout")
    top_p: float = opt(1.0, "nucleus sampling threshold in (0, 1]", "rollout")
    top_k: int = opt(0, "sample among the k most likely tokens (0 = off)", "rollout")
    max_new_tokens: int = opt(512, "tokens generated per completion at most", "rollout")
    max_running_prompts: int = opt(256, "cap on active sequences in the engine's continuous batch", "rollout")
    decode_steps: int = opt(8, "decode steps chained on the device between two scheduling rounds (one CUDA graph; a "
                            "completion that stops early drops the surplus; on a GPU the next chain is queued before "
                            "the current one's tokens are read); 1 = every token", "rollout")
    output_dir: Optional[str] = opt(None, "write every sample (dataset, prompt, completion, answer, score) to "
                                    "DIR/samples.jsonl, and the results to DIR/results.json", "observability",
                                    metavar="DIR")
    output_json: Optional[str] = opt(None, "where the results JSON goes", "observability", metavar="FILE",
                                     default_help="DIR/results.json with --output-dir, else ./eval_results.json")
    verbose: bool = opt(False, "print the resolved configuration to stdout first", "observability")

    # the sampling checks shared with SamplingParams read these
    min_new_tokens = 0
    min_p = 0.0
    repetition_penalty = 1.0
    presence_penalty = 0.0
    frequency_penalty = 0.0

    @property
    def datasets(self) -> list[tuple[str, str]]:
        """--dataset-path as (name, path) pairs."""
        return dataset_specs("--dataset-path", self.dataset_path)

    def __post_init__(self):
        if not self.model_path:
            raise ConfigError("--model-path", "is required (a Hugging Face repo id or a local folder)")
        if not self.dataset_path:
            raise ConfigError("--dataset-path", "is required (NAME=FILE; repeat the flag for several datasets)")
        if isinstance(self.dataset_path, str):
            self.dataset_path = [self.dataset_path]
        dataset_specs("--dataset-path", self.dataset_path)
        if not self.reward_fn_path:
            raise ConfigError("--reward-fn-path", "is required (a Python file defining reward_fn(record))")
        check_file("--reward-fn-path", self.reward_fn_path)
        if self.lora_path and not Path(self.lora_path).expanduser().is_dir():
            raise ConfigError("--lora-path", f"folder not found: {self.lora_path}")
        check_int("--seed", self.seed, 0)
        check_choice("--dtype", self.dtype, DTYPES, optional=True)
        check_sizes(self, ("n_samples", "max_new_tokens", "max_running_prompts", "decode_steps"))
        check_sampling(self, lambda name: "--" + name.replace("_", "-"))
        check_prompt_options(self)
