"""The run configurations: `TrainConfig` (areno train) and `ServeConfig` (areno serve).

Each field is one CLI flag (`--field-name`); its metadata carries the help text, the `--help` group and, where
needed, `choices`, `type`, `action`, `nargs`/`const` and `default_help`. `areno.cli` builds the parser from these
fields with argparse-dataclass, so this file is the single source of truth for flag names, defaults and checks.
`__post_init__` validates everything that can be checked before any work starts and raises `ConfigError` naming
the flag. Imports nothing heavy: the CLI, `--help` and the SDK's argument checks must stay fast.
"""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

import os
import re
from dataclasses import dataclass, field, fields
from typing import Optional

ALGOS = ("sft", "dpo", "grpo", "gspo", "ppo")
LR_STYLES = ("constant", "linear", "cosine")
OFFLOAD_MODES = ("none", "cpu", "disk")
ATTN_BACKENDS = ("flash", "native")
DTYPES = ("bfloat16", "float16", "float32")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
ROUTING_REPLAY = ("auto", "on", "off")
TRAIN_CUDA_GRAPHS = ("auto", "on", "off")

# Order of the sections in `--help`; every field names one of these in its metadata.
GROUPS = {
    "basic": "what to run and on how many ranks",
    "server": "the OpenAI-compatible HTTP server",
    "rollout": "generation and the rollout engine",
    "train": "optimisation and the RL losses",
    "memory": "memory controls",
    "checkpoint": "saving, resuming and reference models",
    "multimodal": "vision/audio towers and projectors",
    "observability": "logging, metrics and progress",
}


class ConfigError(ValueError):
    """A configuration value that cannot work; `flag` names the CLI flag (or SDK argument) at fault."""

    def __init__(self, flag: str, reason: str):
        self.flag = flag
        self.reason = reason
        super().__init__(f"{flag} {reason}")


class RunError(RuntimeError):
    """A run that had to stop on its own terms (every reward failing, a full disk, ...): the CLI prints the message
    as one line and exits 1; what could be saved has been saved."""


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def opt(default, help: str, group: str, **meta):
    """A config field: default, help text, `--help` group and any extra argparse metadata."""
    assert group in GROUPS, group
    return field(default=default, metadata={"help": help, "group": group, **meta})


# ---- argument types (also accept the already-parsed value, so replace()/the SDK can pass Python objects) ----


def device_list(text) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; inclusive ranges too: '0..3,6' -> [0, 1, 2, 3, 6]; a list of ints passes through."""
    if isinstance(text, (list, tuple)):
        items = list(text)
    else:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        devices = []
        for d in items:
            if isinstance(d, str) and ".." in d:
                low, high = (int(x) for x in d.split(".."))
                if high < low:
                    raise ValueError(d)
                devices += range(low, high + 1)
            else:
                devices.append(int(d))
    except (TypeError, ValueError) as e:
        raise ValueError(f"expected comma-separated GPU indices or inclusive ranges like 0..3,6, got {text!r}") from e
    if not devices or any(d < 0 for d in devices):
        raise ValueError(f"expected comma-separated non-negative GPU indices, got {text!r}")
    return devices


device_list.__name__ = "GPU index list"  # argparse prints the type's name in "invalid ... value"

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 1e9,
          "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def memory_amount(text) -> float:
    """A fraction of free device memory (0 < x <= 1) or a byte count: '0.9', '40GiB', '4e10'."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"expected a fraction such as 0.9 or a size such as 40GiB, got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    return value if m.group(2) == "" else float(int(value))


memory_amount.__name__ = "memory amount"


# ---- checks shared by the configs here and the SDK configs in areno.api ----


def check_positive(name, value, *, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")


def check_non_negative(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(name, f"must be >= 0, got {value!r}")


def check_range(name, value, low, high, *, low_open=False, high_open=False):
    ok_low = value > low if low_open else value >= low
    ok_high = value < high if high_open else value <= high
    if not (ok_low and ok_high):
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise ConfigError(name, f"must be in {lo}{low}, {high}{hi}, got {value!r}")


def check_choice(name, value, choices, *, optional=False):
    if value is None and optional:
        return
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}, got {value!r}")


def check_file(name, path):
    if path is not None and not os.path.isfile(path):
        raise ConfigError(name, f"file does not exist: {path}")


def check_memory(name, value):
    if value is not None and not value > 0:
        raise ConfigError(name, f"must be a fraction of free memory in (0, 1] or a byte count > 1, got {value!r}")


def check_offload(prefix, mode, folder, batch_size):
    """The three optimizer-offload settings, flag names built from `prefix` (CLI `--` or SDK `runtime[...]`)."""
    check_choice(prefix("optimizer_state_offload"), mode, OFFLOAD_MODES)
    check_positive(prefix("optimizer_state_offload_batch_size"), batch_size)
    if mode == "disk" and not folder:
        raise ConfigError(prefix("optimizer_state_offload_dir"), f"is required with {prefix('optimizer_state_offload')}"
                          " disk (a local folder, ideally NVMe, for the optimizer-state mmap files)")
    if folder and mode != "disk":
        raise ConfigError(prefix("optimizer_state_offload_dir"), f"only applies to {prefix('optimizer_state_offload')}"
                          f" disk, not {mode!r}")


def check_sizes(config, names):
    """Positive integers; a field whose default is None may stay None."""
    defaults = {f.name: f.default for f in fields(config)}
    for name in names:
        check_positive(flag_name(name), getattr(config, name), optional=defaults[name] is None)


def format_config(config) -> str:
    """The resolved configuration, one aligned `key : value` line per field (secrets masked)."""
    names = [f.name for f in fields(config)]
    width = max(len(n) for n in names)
    secret = {f.name for f in fields(config) if f.metadata.get("secret")}

    def shown(name):
        value = getattr(config, name)
        return "'***'" if name in secret and value else repr(value)

    return "\n".join(f"  {n.ljust(width)} : {shown(n)}" for n in names)


# ---- flags of features not built yet: refused (exit 2) when given, never parsed and ignored ----
NOT_BUILT: dict[str, str] = {}


def check_media_limits(config) -> None:
    """The image caps of the message schema (``MediaLimits``), shared by train and serve."""
    check_sizes(config, ("max_image_bytes", "max_image_pixels", "max_images_per_prompt"))


_IMAGE_BYTES_HELP = ("largest encoded image accepted in a prompt, in bytes (a larger one is refused: exit 2 for a "
                     "dataset row, HTTP 400 for a request)")
_IMAGE_PIXELS_HELP = "largest image accepted, in pixels (width x height, before the processor resizes it)"
_IMAGES_HELP = "most images accepted in one prompt"


def refuse_not_built(config) -> None:
    """A ``ConfigError`` for the first field of ``NOT_BUILT`` set to anything but its default."""
    for f in fields(config):
        if f.name in NOT_BUILT and getattr(config, f.name) != f.default:
            raise ConfigError(flag_name(f.name), NOT_BUILT[f.name])


# ---- the configs (fields in `--help` order within each group) ----


@dataclass
class TrainConfig:
    """`areno train`: one RL/SFT/DPO run."""

    # basic
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

    # rollout
    train_devices: Optional[list[int]] = opt(
        None, "GPU indices of the training ranks, e.g. 0..3 or 0,1,2,3 (one per rank: the world size is its length)",
        "rollout", type=device_list, metavar="IDS", default_help="GPUs 0..world size - 1")
    rollout_devices: Optional[list[int]] = opt(
        None, "GPU indices of a separate rollout partition, e.g. 4..7 (split mode: rollout engines run there and the "
        "policy is streamed to them after each optimizer step; needs --train-devices)", "rollout", type=device_list,
        metavar="IDS", default_help="off: rollout is colocated on the training ranks")
    rollout_tp_size: Optional[int] = opt(None, "tensor-parallel size of each rollout engine in split mode", "rollout",
                                         default_help="--tp-size")
    max_context_len: Optional[int] = opt(
        None, "agentic rollout: tokens of a whole trajectory (prompt, turns, tool results)", "rollout",
        default_help="--max-prompt-tokens + --max-new-tokens")
    agent_timeout_s: float = opt(300.0, "agentic rollout: seconds one sample's agent may run before it is scored 0.0 "
                                 "as a failure (0 = no limit)", "rollout")
    train_tool_results: bool = opt(False, "agentic rollout: train on tool-result tokens too (by default only the "
                                   "sampled tokens are trained)", "rollout")
    policy_sync_bucket_mb: float = opt(64.0, "split mode: MiB per bucket of the policy streamed to the rollout "
                                       "engines", "rollout")
    max_staleness: int = opt(0, "split mode: 0 = on-policy (the rollout waits for the new policy); 1 = one-step-off "
                             "async (the next rollout runs while this step trains)", "rollout", choices=(0, 1))
    max_running_prompts: Optional[int] = opt(
        None, "cap on active rollout sequences (and their KV-cache demand)", "rollout",
        default_help="the whole rollout batch")
    max_prompt_tokens: int = opt(1024, "prompts longer than this are truncated from the left", "rollout")
    max_new_tokens: int = opt(1024, "maximum generated tokens per completion", "rollout")
    min_new_tokens: int = opt(0, "minimum generated tokens before EOS/stop may end a completion", "rollout")
    temperature: float = opt(1.0, "sampling temperature (0 = greedy)", "rollout")
    top_p: float = opt(1.0, "nucleus sampling threshold in (0, 1]", "rollout")
    top_k: int = opt(0, "top-k sampling (0 = off)", "rollout")
    min_p: float = opt(0.0, "min-p sampling in [0, 1]: drop tokens less likely than this times the most likely one "
                       "(after temperature; 0 = off)", "rollout")
    repetition_penalty: float = opt(
        1.0, "divide the positive logits (multiply the negative ones) of tokens already in the prompt or completion by "
        "this, before temperature (> 0; 1 = off); rollout log-probs are then those of the penalised distribution",
        "rollout")
    presence_penalty: float = opt(0.0, "subtract this from the logits of tokens already in the completion, in [-2, 2]"
                                  " (0 = off)", "rollout")
    frequency_penalty: float = opt(0.0, "subtract this times a token's count in the completion from its logit, in "
                                   "[-2, 2] (0 = off)", "rollout")
    stop: Optional[list[str]] = opt(None, "stop string (repeat the flag for several)", "rollout", action="append",
                                    type=str, metavar="TEXT")
    attn_backend: Optional[str] = opt(
        None, "attention implementation: flash where the model and GPU support it, native for compatibility",
        "rollout", choices=ATTN_BACKENDS, default_help="the setup recorded by scripts/install.sh")
    eager_decode: bool = opt(False, "disable CUDA-graph replay for rollout decode", "rollout")
    decode_steps: int = opt(8, "decode steps chained on the device between two scheduling rounds of the rollout "
                            "(one CUDA graph; a completion that stops early drops the surplus; on a GPU the next "
                            "chain is queued before the current one's tokens are read); 1 = every token",
                            "rollout")

    # train
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
        "required (refused for a dense policy or a non-RL --algo); off", "train", choices=ROUTING_REPLAY)
    train_cuda_graphs: str = opt(
        "auto", "replay each text microbatch's forward/backward and the optimizer step as CUDA graphs per shape "
        "bucket (no Python launch gaps). auto = on for a dense text policy on CUDA without activation checkpointing, "
        "TP or routing replay, outside colocated RL (whose rollout engine shares the GPU's memory: eager there, as "
        "are other policies and the PPO critic); on = required (refused where it cannot "
        "apply); off", "train", choices=TRAIN_CUDA_GRAPHS)
    max_steps: Optional[int] = opt(None, "stop after this many steps", "train", default_help="--epochs over the data")
    epochs: int = opt(1, "passes over the dataset", "train")
    ppo_epochs: int = opt(1, "optimizer passes over each rollout batch (grpo, gspo, ppo)", "train")
    dpo_beta: float = opt(0.1, "DPO inverse temperature", "train")
    dpo_label_smoothing: float = opt(0.0, "DPO label smoothing (conservative DPO), in [0, 0.5)", "train")
    clip_eps_low: float = opt(0.2, "lower clip of the token importance ratio: 1 - eps", "train")
    clip_eps_high: float = opt(0.28, "upper clip of the token importance ratio: 1 + eps", "train")
    gspo_clip_eps: float = opt(3e-4, "GSPO sequence-level ratio clip", "train")
    kl_coef: float = opt(0.0, "KL penalty to the reference policy (0 = no reference model)", "train")
    kl_estimator: str = opt("k3", "KL estimator", "train", choices=KL_ESTIMATORS)
    entropy_coef: float = opt(0.0, "entropy bonus", "train")
    advantage_std_norm: bool = opt(True, "divide group advantages by the group reward std", "train")
    tis_cap: float = opt(2.0, "truncated importance sampling cap on rollout/trainer mismatch (0 = off)", "train")
    loss_agg: str = opt("token-mean", "how token losses are aggregated over the global batch", "train",
                        choices=LOSS_AGGS)
    filter_zero_variance_groups: bool = opt(False, "drop groups whose rewards are all equal", "train")
    critic_lr: Optional[float] = opt(None, "PPO critic learning rate", "train", default_help="--lr")
    gamma: float = opt(1.0, "PPO discount", "train")
    gae_lambda: float = opt(0.95, "PPO GAE lambda", "train")
    value_clip: float = opt(0.2, "PPO value-loss clip (0 = off)", "train")
    dual_clip: float = opt(3.0, "PPO dual-clip constant c > 1 for negative advantages (0 = off)", "train")
    critic_warmup_steps: int = opt(0, "PPO steps that train only the critic", "train")
    sft_warmup_steps: int = opt(0, "SFT steps on the rows' `response` before RL starts (grpo, gspo, ppo)", "train")
    sft_warmup_lr: float = opt(0.0, "peak learning rate of the SFT warm-up steps (0 = --lr); the RL schedule starts "
                               "fresh after them", "train")
    reward_timeout_s: float = opt(60.0, "seconds one reward_fn call may run before its sample is scored 0.0 as a "
                                  "failure (0 = no limit)", "train")
    max_reward_failure_steps: int = opt(3, "stop the run (exit 1, after saving) once every reward of this many steps "
                                        "in a row failed (0 = never)", "train")

    # memory
    drop_rollout_state: bool = opt(False, "release KV cache and graphs at each rollout session boundary", "memory")
    activation_checkpointing: bool = opt(True, "recompute decoder activations during backward", "memory")
    optimizer_state_offload: str = opt("none", "where optimizer state lives between train calls", "memory",
                                       choices=OFFLOAD_MODES)
    optimizer_state_offload_dir: Optional[str] = opt(
        None, "folder for --optimizer-state-offload disk (scratch files, not a checkpoint)", "memory", metavar="DIR")
    optimizer_state_offload_batch_size: int = opt(1, "mmap files grouped per flush for disk offload", "memory")
    kv_cache_memory: Optional[float] = opt(
        None, "KV-cache budget: a fraction of free GPU memory (0.9) or a size (40GiB)", "memory",
        type=memory_amount, metavar="AMOUNT", default_help="the runtime decides")

    # checkpoint
    save_path: Optional[str] = opt(None, "folder for checkpoints (Hugging Face layout plus training state)",
                                   "checkpoint", metavar="DIR")
    save_interval: int = opt(0, "save every N steps (0 = only at the end)", "checkpoint")
    overwrite: bool = opt(False, "start a new run in a --save-path that already holds files: its checkpoints and "
                          "metrics are removed first (without it such a folder is refused unless --resume)",
                          "checkpoint")
    resume: Optional[str] = opt(None, "resume from a checkpoint folder, or with no value from the latest under "
                                "--save-path", "checkpoint", nargs="?", const="latest", metavar="PATH")
    ref_ckpt: Optional[str] = opt(None, "reference model for KL and DPO", "checkpoint", metavar="PATH",
                                  default_help="--ckpt")
    critic_ckpt: Optional[str] = opt(None, "PPO critic checkpoint", "checkpoint", metavar="PATH",
                                     default_help="a value head on a copy of --ckpt")

    # multimodal
    unfreeze_mm_tower: bool = opt(False, "train the vision/audio tower as its own optimizer group with its own "
                             "schedule (--mm-tower-*; frozen unless given)", "multimodal")
    unfreeze_mm_projector: bool = opt(False, "train the projector/merger as its own optimizer group with its own "
                                 "schedule (--mm-projector-*; frozen unless given)", "multimodal")
    mm_tower_lr: Optional[float] = opt(None, "tower peak learning rate", "multimodal", default_help="--lr")
    mm_tower_min_lr: Optional[float] = opt(None, "tower final learning rate", "multimodal", default_help="--min-lr")
    mm_tower_lr_steps: Optional[int] = opt(None, "tower schedule length in optimizer updates (as --warmup-steps)",
                                           "multimodal", default_help="the run length")
    mm_tower_lr_style: Optional[str] = opt(None, "tower schedule", "multimodal", choices=LR_STYLES,
                                           default_help="--lr-decay-style")
    mm_projector_lr: Optional[float] = opt(None, "projector peak learning rate", "multimodal", default_help="--lr")
    mm_projector_min_lr: Optional[float] = opt(None, "projector final learning rate", "multimodal",
                                               default_help="--min-lr")
    mm_projector_lr_steps: Optional[int] = opt(None, "projector schedule length in optimizer updates (as "
                                               "--warmup-steps)", "multimodal", default_help="the run length")
    mm_projector_lr_style: Optional[str] = opt(None, "projector schedule", "multimodal", choices=LR_STYLES,
                                               default_help="--lr-decay-style")
    max_image_bytes: int = opt(20 << 20, _IMAGE_BYTES_HELP, "multimodal")
    max_image_pixels: int = opt(50_000_000, _IMAGE_PIXELS_HELP, "multimodal")
    max_images_per_prompt: int = opt(64, _IMAGES_HELP, "multimodal")

    # observability
    metrics_dir: Optional[str] = opt(None, "folder for metrics JSON lines and TensorBoard events", "observability",
                                     metavar="DIR", default_help="<save-path>/metrics, else ./runs/latest")
    log_interval: int = opt(1, "print a metrics line every N steps", "observability")
    verbose: bool = opt(False, "also print the resolved configuration to stdout (it is always written to "
                        "config.json in the metrics folder)", "observability")
    eval_interval: int = opt(0, "evaluate held-out prompts every N steps (0 = off)", "observability")
    tensorboard: bool = opt(True, "write TensorBoard events beside the JSON lines", "observability")
    rollout_dump_dir: Optional[str] = opt(
        None, "write every RL step's rows as JSON lines (token ids, loss mask, rollout log-probs, policy version, "
        "reward, finish reason; an agent's messages) to DIR/step-N.jsonl", "observability", metavar="DIR")
    decode_progress_interval_s: float = opt(0.0, "report decode throughput every N seconds (0 = off)",
                                            "observability")

    def __post_init__(self):
        for name in ("train_devices", "rollout_devices"):
            value = getattr(self, name)
            if value is not None:
                try:
                    setattr(self, name, device_list(value))
                except ValueError as e:
                    raise ConfigError(flag_name(name), str(e)) from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_required()
        check_sizes(self, ("world_size", "tp_size", "batch_size", "n_samples", "mini_bs", "gradient_accumulation_steps",
                           "rollout_tp_size", "max_running_prompts", "max_prompt_tokens", "max_new_tokens",
                           "max_steps", "epochs", "ppo_epochs", "log_interval", "mm_tower_lr_steps",
                           "mm_projector_lr_steps"))
        if self.train_devices is not None and self.world_size == 1:
            self.world_size = len(self.train_devices)  # the world size is the train list's length
        if self.rollout_devices is None and self.rollout_tp_size not in (None, self.tp_size):
            raise ConfigError("--rollout-tp-size", "applies to split mode only (--rollout-devices); colocated rollout "
                              "uses --tp-size")
        if self.world_size % self.tp_size:
            raise ConfigError("--world-size", f"{self.world_size} is not divisible by --tp-size {self.tp_size}")
        for name, choices in (("algo", ALGOS), ("lr_decay_style", LR_STYLES), ("kl_estimator", KL_ESTIMATORS),
                              ("loss_agg", LOSS_AGGS), ("attn_backend", ATTN_BACKENDS), ("dtype", DTYPES),
                              ("mm_tower_lr_style", LR_STYLES), ("mm_projector_lr_style", LR_STYLES),
                              ("train_cuda_graphs", TRAIN_CUDA_GRAPHS)):
            check_choice(flag_name(name), getattr(self, name), choices, optional=True)
        check_offload(flag_name, self.optimizer_state_offload, self.optimizer_state_offload_dir,
                      self.optimizer_state_offload_batch_size)
        refuse_not_built(self)
        check_media_limits(self)
        self._check_multimodal()
        self._check_devices()
        self._check_agent()
        self._check_sampling()
        self._check_optimisation()
        check_memory("--kv-cache-memory", self.kv_cache_memory)
        if self.resume and self.overwrite:
            raise ConfigError("--overwrite", "and --resume contradict each other: resume continues the run in "
                              "--save-path, overwrite removes it")
        if self.overwrite and not self.save_path:
            raise ConfigError("--overwrite", "needs --save-path (the folder whose previous run it replaces)")
        if self.resume == "latest" and not self.save_path:
            raise ConfigError("--resume", "without a folder resumes the latest checkpoint under --save-path; "
                              "set --save-path or give the checkpoint folder")

    @property
    def metrics_folder(self) -> str:
        """Where metrics.jsonl, TensorBoard events and config.json go."""
        return self.metrics_dir or (os.path.join(self.save_path, "metrics") if self.save_path else "runs/latest")

    def _check_required(self):
        if not self.ckpt:
            raise ConfigError("--ckpt", "is required (a Hugging Face repo id or a local checkpoint folder)")
        check_file("--dataset-loader-fn", self.dataset_loader_fn)
        check_file("--reward-fn-path", self.reward_fn_path)
        check_file("--agent-fn", self.agent_fn)

    def require_run_inputs(self):
        """What a whole `areno train` run needs beyond the model (the SDK may pass its batches itself)."""
        if not self.dataset_path and not self.dataset_loader_fn:
            raise ConfigError("--dataset-path", "is required (unless --dataset-loader-fn builds the data itself)")
        if self.algo in ("grpo", "gspo", "ppo") and not self.reward_fn_path and not self.agent_fn:
            raise ConfigError("--reward-fn-path", f"is required for --algo {self.algo} (unless --agent-fn returns "
                              "the rewards)")

    def _check_agent(self):
        if self.agent_fn is None:
            for name in ("max_context_len", "agent_timeout_s", "train_tool_results"):
                if getattr(self, name) != TrainConfig.__dataclass_fields__[name].default:
                    raise ConfigError(flag_name(name), "applies to agentic rollout only (--agent-fn)")
            return
        if self.algo not in ("grpo", "gspo"):
            raise ConfigError("--agent-fn", f"agentic rollout trains with grpo or gspo, not --algo {self.algo}")
        if self.max_staleness:
            raise ConfigError("--max-staleness", "agentic rollout is on-policy: --max-staleness 1 does not apply to "
                              "--agent-fn runs yet")
        check_positive("--max-context-len", self.max_context_len, optional=True)
        check_non_negative("--agent-timeout-s", self.agent_timeout_s)

    @property
    def rollout_tp(self) -> int:
        """Each split-mode rollout engine's TP size (``--rollout-tp-size``, default ``--tp-size``)."""
        return self.rollout_tp_size or self.tp_size

    @property
    def split(self) -> bool:
        """Split mode: rollout engines on their own devices (``--rollout-devices``)."""
        return self.rollout_devices is not None

    def _check_devices(self):
        train, rollout = self.train_devices, self.rollout_devices
        if rollout is not None and train is None:
            raise ConfigError("--rollout-devices", "needs --train-devices too (split mode places both partitions)")
        if train is None:
            for name in ("policy_sync_bucket_mb", "max_staleness"):
                if getattr(self, name) != TrainConfig.__dataclass_fields__[name].default:
                    raise ConfigError(flag_name(name), "applies to split mode only (--train-devices and "
                                      "--rollout-devices)")
            return
        for name, devices in (("--train-devices", train), ("--rollout-devices", rollout or [])):
            if len(set(devices)) != len(devices):
                raise ConfigError(name, f"lists a GPU twice: {devices}")
        if len(train) != self.world_size:
            raise ConfigError("--world-size", f"{self.world_size} conflicts with --train-devices, which lists "
                              f"{len(train)} GPUs (the world size is its length)")
        if rollout is None:
            return
        if self.algo not in ("grpo", "gspo", "ppo"):
            raise ConfigError("--rollout-devices", f"split mode is for online algorithms (grpo, gspo, ppo), not "
                              f"--algo {self.algo}")
        overlap = sorted(set(train) & set(rollout))
        if overlap:
            raise ConfigError("--rollout-devices", f"overlaps --train-devices on GPU {overlap} (the partitions must "
                              "be disjoint)")
        if len(rollout) % self.rollout_tp:
            raise ConfigError("--rollout-devices", f"lists {len(rollout)} GPUs, not divisible by --rollout-tp-size "
                              f"{self.rollout_tp}")
        if not self.policy_sync_bucket_mb > 0:
            raise ConfigError("--policy-sync-bucket-mb", f"must be > 0, got {self.policy_sync_bucket_mb}")

    def _check_sampling(self):
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError("--min-new-tokens", f"must be between 0 and --max-new-tokens, got {self.min_new_tokens}")
        check_non_negative("--temperature", self.temperature)
        check_range("--top-p", self.top_p, 0.0, 1.0, low_open=True)
        check_non_negative("--top-k", self.top_k)
        check_range("--min-p", self.min_p, 0.0, 1.0)
        check_range("--repetition-penalty", self.repetition_penalty, 0.0, 3.4028234663852886e38, low_open=True)
        check_range("--presence-penalty", self.presence_penalty, -2.0, 2.0)
        check_range("--frequency-penalty", self.frequency_penalty, -2.0, 2.0)
        check_non_negative("--decode-progress-interval-s", self.decode_progress_interval_s)
        check_positive("--decode-steps", self.decode_steps)
        if self.algo in ("grpo", "gspo") and self.n_samples < 2:
            raise ConfigError("--n-samples", f"must be >= 2 for --algo {self.algo} (group advantages compare "
                              "several samples of one prompt)")

    def _check_multimodal(self):
        """A tower/projector schedule flag needs its part unfrozen; a final rate may not exceed its peak (whether
        the model has a tower at all is checked once it is loaded: areno.training.multimodal.check_flags)."""
        for part in ("tower", "projector"):
            names = [f"mm_{part}_{x}" for x in ("lr", "min_lr", "lr_steps", "lr_style")]
            given = [n for n in names if getattr(self, n) is not None]
            if given and not getattr(self, f"unfreeze_mm_{part}"):
                raise ConfigError(flag_name(given[0]), f"applies only with --unfreeze-mm-{part} (the {part} is frozen "
                                  "otherwise)")
            peak, low = getattr(self, f"mm_{part}_lr"), getattr(self, f"mm_{part}_min_lr")
            if low is not None and low > (self.lr if peak is None else peak):
                raise ConfigError(f"--mm-{part}-min-lr", f"({low}) must not exceed the {part}'s peak rate "
                                  f"{'--mm-' + part + '-lr' if peak is not None else '--lr'} "
                                  f"({self.lr if peak is None else peak})")

    def _check_optimisation(self):
        if self.train_cuda_graphs == "on" and self.activation_checkpointing:
            raise ConfigError("--train-cuda-graphs", "on needs --no-activation-checkpointing (recomputation in the "
                              "backward is not graphed)")
        if self.train_cuda_graphs == "on" and self.tp_size > 1:
            raise ConfigError("--train-cuda-graphs", "on does not apply with --tp-size > 1 (TP is not graphed)")
        if self.routing_replay == "on" and self.algo not in ("grpo", "gspo", "ppo"):
            raise ConfigError("--routing-replay", f"on applies to RL with rollout (grpo, gspo, ppo), not --algo "
                              f"{self.algo}")
        if not self.lr > 0:
            raise ConfigError("--lr", f"must be > 0, got {self.lr}")
        check_range("--min-lr", self.min_lr, 0.0, self.lr)
        for name in ("warmup_steps", "weight_decay", "grad_clip", "save_interval", "eval_interval",
                     "critic_warmup_steps", "sft_warmup_steps", "sft_warmup_lr", "kl_coef", "entropy_coef", "tis_cap",
                     "value_clip", "clip_eps_high", "reward_timeout_s", "max_reward_failure_steps",
                     "router_bias_update_rate"):
            check_non_negative(flag_name(name), getattr(self, name))
        for name in ("critic_lr", "mm_tower_lr", "mm_tower_min_lr", "mm_projector_lr", "mm_projector_min_lr"):
            if getattr(self, name) is not None:
                check_non_negative(flag_name(name), getattr(self, name))
        check_range("--clip-eps-low", self.clip_eps_low, 0.0, 1.0, high_open=True)
        check_range("--gspo-clip-eps", self.gspo_clip_eps, 0.0, 1.0, low_open=True)
        if not self.dpo_beta > 0:
            raise ConfigError("--dpo-beta", f"must be > 0, got {self.dpo_beta}")
        check_range("--dpo-label-smoothing", self.dpo_label_smoothing, 0.0, 0.5, high_open=True)
        check_range("--gamma", self.gamma, 0.0, 1.0)
        check_range("--gae-lambda", self.gae_lambda, 0.0, 1.0)
        if self.dual_clip != 0 and not self.dual_clip > 1:
            raise ConfigError("--dual-clip", f"must be > 1 (or 0 to turn it off), got {self.dual_clip}")


@dataclass
class ServeConfig:
    """`areno serve`: the OpenAI-compatible server over one rollout session."""

    model_path: Optional[str] = opt(None, "model: a Hugging Face repo id or a local folder (required)", "basic",
                                    metavar="PATH")
    world_size: int = opt(1, "worker ranks (one process per GPU)", "basic")
    tp_size: int = opt(1, "tensor-parallel size; --world-size must be divisible by it", "basic")
    dtype: Optional[str] = opt(None, "parameter/compute dtype", "basic", choices=DTYPES,
                               default_help="bfloat16 on GPU; float32 on a CPU without bfloat16 support")
    seed: int = opt(0, "base seed for requests that give none", "basic")
    host: str = opt("127.0.0.1", "address to listen on", "server", metavar="ADDR")
    port: int = opt(8000, "port to listen on (0 = any free port)", "server")
    api_key: Optional[str] = opt(None, "require this bearer token on every request", "server", metavar="KEY",
                                secret=True)
    served_model_name: Optional[str] = opt(None, "model name reported by /v1/models and accepted in requests",
                                           "server", metavar="NAME", default_help="the --model-path")
    max_model_len: Optional[int] = opt(None, "maximum prompt + completion tokens per request", "server",
                                       default_help="the model's context length")
    max_request_bytes: int = opt(32 << 20, "largest request body accepted, in bytes (a larger one gets HTTP 413)",
                                 "server")
    max_running_prompts: int = opt(32, "cap on active sequences in the continuous batch", "rollout")
    attn_backend: Optional[str] = opt(
        None, "attention implementation: flash where the model and GPU support it, native for compatibility",
        "rollout", choices=ATTN_BACKENDS, default_help="the setup recorded by scripts/install.sh")
    eager_decode: bool = opt(False, "disable CUDA-graph replay for decode", "rollout")
    engine_thread: bool = opt(
        False, "run the engine in a thread of the HTTP process instead of its own engine-core process (slower under "
        "load: the HTTP path and the engine share one interpreter lock; a --world-size == --tp-size > 1 server "
        "always runs its engine on TP rank 0)", "server")
    kv_cache_memory: Optional[float] = opt(
        None, "KV-cache budget: a fraction of free GPU memory (0.9) or a size (40GiB)", "memory",
        type=memory_amount, metavar="AMOUNT", default_help="the runtime decides")
    max_image_bytes: int = opt(20 << 20, _IMAGE_BYTES_HELP, "multimodal")
    max_image_pixels: int = opt(50_000_000, _IMAGE_PIXELS_HELP, "multimodal")
    max_images_per_prompt: int = opt(64, _IMAGES_HELP, "multimodal")
    decode_progress_interval_s: float = opt(
        0.0, "report decode throughput, active sequences and graph replay every N seconds (0 = off)",
        "observability")
    verbose: bool = opt(False, "print the resolved configuration to stdout before serving", "observability")

    def __post_init__(self):
        if not self.model_path:
            raise ConfigError("--model-path", "is required (a Hugging Face repo id or a local folder)")
        check_sizes(self, ("world_size", "tp_size", "max_running_prompts", "max_model_len", "max_request_bytes"))
        if self.world_size % self.tp_size:
            raise ConfigError("--world-size", f"{self.world_size} is not divisible by --tp-size {self.tp_size}")
        check_choice("--attn-backend", self.attn_backend, ATTN_BACKENDS, optional=True)
        check_choice("--dtype", self.dtype, DTYPES, optional=True)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError("--port", f"must be in [0, 65535], got {self.port!r}")
        if not self.host:
            raise ConfigError("--host", "must not be empty")
        check_memory("--kv-cache-memory", self.kv_cache_memory)
        check_non_negative("--decode-progress-interval-s", self.decode_progress_interval_s)
        check_media_limits(self)
