"""The SDK surface: backend types (`CUDA`, `MLX`) and their configs, `SamplingParams`, and `Trainer`.

Backend selection is automatic and never falls back across platforms: Linux selects CUDA, macOS on arm64 selects
MLX (not part of this build: an explicit error), anything else fails at once. A typed config that does not match
the backend (`CudaConfig` with `backend_type=MLX`, `MlxConfig` with `backend_type=CUDA`) fails at construction.
Light to import: torch and the runtime are imported only by the methods that run work.
"""

import enum
import os
import platform
from dataclasses import dataclass, field
from typing import ClassVar

from areno.config import ConfigError, SamplingParams
from areno.config.constants import ATTN_BACKENDS, DTYPES, OPTIMIZER_STATES
from areno.config.fields import (
    check_bool,
    check_choice,
    check_memory,
    check_non_negative,
    check_number,
    check_offload,
    check_positive,
    device_list,
)


class BackendType(enum.Enum):
    CUDA = "cuda"
    MLX = "mlx"


CUDA = BackendType.CUDA
MLX = BackendType.MLX

MLX_NOT_BUILT = ("The MLX backend is not part of this build (macOS on arm64 selects MLX); "
                 "areno here runs the CUDA backend on Linux")


def _check_folder(name, value):
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ConfigError(name, f"must be a folder path, got {value!r}")


# CudaConfig.runtime: key -> check(name, value). The keys mirror the CLI's runtime flags.
RUNTIME_KEYS = {
    "attn_backend": lambda n, v: check_choice(n, v, ATTN_BACKENDS),
    "eager_decode": check_bool,
    "drop_rollout_state": check_bool,
    "activation_checkpointing": check_bool,
    "optimizer_states": lambda n, v: check_choice(n, v, OPTIMIZER_STATES),
    "optimizer_state_offload": lambda n, v: None,  # checked with its two companions below
    "optimizer_state_offload_dir": _check_folder,
    "optimizer_state_offload_batch_size": check_positive,
    "decode_progress_interval_s": check_non_negative,
    "kv_cache_memory": lambda n, v: check_number(n, v) or check_memory(n, v),
    "dtype": lambda n, v: check_choice(n, v, DTYPES),
}


def _check_devices(name, devices):
    if devices is None:
        return None
    try:
        devices = device_list(devices)
    except ValueError as e:
        raise ConfigError(name, str(e)) from None
    if len(set(devices)) != len(devices):
        raise ConfigError(name, f"lists a GPU twice: {devices}")
    return devices


@dataclass
class CudaConfig:
    """CUDA backend settings: tensor parallelism, GPU indices, rollout concurrency and runtime switches.

    ``rollout_devices`` (with ``devices``) selects split mode: rollout engines of ``rollout_tp_size`` (default
    ``tp_size``) ranks on those GPUs, the policy streamed to them after each optimizer step. Run the script under
    ``torchrun`` with one process per train and rollout device: on a rollout rank ``Trainer.init()`` serves rollouts
    until the train side closes, then exits the process.
    """

    tp_size: int = 1
    devices: list[int] | None = None
    max_running_prompts: int | None = None
    rollout_devices: list[int] | None = None
    rollout_tp_size: int | None = None
    runtime: dict = field(default_factory=dict)
    backend_type: ClassVar[BackendType] = CUDA

    def __post_init__(self):
        check_positive("tp_size", self.tp_size)
        self.devices = _check_devices("devices", self.devices)
        self.rollout_devices = _check_devices("rollout_devices", self.rollout_devices)
        check_positive("rollout_tp_size", self.rollout_tp_size, optional=True)
        if self.rollout_devices is not None and self.devices is None:
            raise ConfigError("rollout_devices", "needs devices too (split mode places both partitions)")
        check_positive("max_running_prompts", self.max_running_prompts, optional=True)
        if not isinstance(self.runtime, dict):
            raise ConfigError("runtime", f"must be a dict, got {type(self.runtime).__name__}")
        unknown = sorted(set(self.runtime) - set(RUNTIME_KEYS))
        if unknown:
            raise ConfigError("runtime", f"has unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
                              f"{', '.join(RUNTIME_KEYS)}")
        for key, value in self.runtime.items():
            RUNTIME_KEYS[key](f"runtime[{key!r}]", value)
        check_offload(lambda key: f"runtime[{key!r}]", self.runtime.get("optimizer_state_offload", "none"),
                      self.runtime.get("optimizer_state_offload_dir"),
                      self.runtime.get("optimizer_state_offload_batch_size", 1))


@dataclass
class MlxConfig:
    """MLX backend settings (the backend is not part of this build; the type exists so configs stay portable)."""

    max_running_prompts: int | None = None
    max_kv_size: int | None = None  # tokens kept per sequence in the rotating KV cache
    quantize_bits: int | None = None  # load the model quantised to 4 or 8 bits
    backend_type: ClassVar[BackendType] = MLX

    def __post_init__(self):
        check_positive("max_running_prompts", self.max_running_prompts, optional=True)
        check_positive("max_kv_size", self.max_kv_size, optional=True)
        if self.quantize_bits is not None and self.quantize_bits not in (4, 8):
            raise ConfigError("quantize_bits", f"must be 4 or 8, got {self.quantize_bits!r}")


BACKEND_CONFIGS = {CUDA: CudaConfig, MLX: MlxConfig}


def _as_backend_type(value) -> BackendType:
    if isinstance(value, BackendType):
        return value
    raw = getattr(value, "value", value)  # another enum with the same values (e.g. from areno.platform)
    if isinstance(raw, str) and raw.lower() in {b.value for b in BackendType}:
        return BackendType(raw.lower())
    raise TypeError(f"backend_type must be areno.api.CUDA or areno.api.MLX, got {value!r}")


def platform_backend() -> BackendType:
    """The backend this host selects: areno.platform's choice when present, else by OS and machine."""
    try:
        from areno.platform import select_backend
    except ImportError as e:
        if e.name != "areno.platform":
            raise
    else:
        return _as_backend_type(select_backend())
    system, machine = platform.system(), platform.machine()
    if system == "Linux":
        return CUDA
    if system == "Darwin" and machine.lower() in ("arm64", "aarch64"):
        return MLX
    raise RuntimeError(f"areno does not run on {system} {machine}: Linux selects the CUDA backend and macOS on "
                       "arm64 the MLX backend; there is no fallback to another platform's backend")


def resolve_backend(backend_type=None, custom_config=None):
    """Check `backend_type` against `custom_config` and the host; return `(BackendType, config)`.

    A config of the other backend's type raises `TypeError` (before anything else); asking for a backend the host
    does not select, or landing on MLX, raises `RuntimeError`. Without a config, the backend's default config.
    """
    if custom_config is not None and not isinstance(custom_config, (CudaConfig, MlxConfig)):
        raise TypeError(f"custom_config must be a CudaConfig or an MlxConfig, got {type(custom_config).__name__}")
    requested = None if backend_type is None else _as_backend_type(backend_type)
    if custom_config is not None and requested is not None and custom_config.backend_type is not requested:
        raise TypeError(f"{type(custom_config).__name__} configures the {custom_config.backend_type.name} backend "
                        f"but backend_type={requested.name}; use {BACKEND_CONFIGS[requested].__name__} or omit "
                        "backend_type")
    selected = platform_backend()
    if custom_config is not None and custom_config.backend_type is not selected:
        raise TypeError(f"{type(custom_config).__name__} configures the {custom_config.backend_type.name} backend "
                        f"but this host selects {selected.name}; use {BACKEND_CONFIGS[selected].__name__}")
    if requested is MLX or selected is MLX:
        raise RuntimeError(MLX_NOT_BUILT)
    if requested is not None and requested is not selected:
        raise RuntimeError(f"backend_type={requested.name} is not available here: this host selects {selected.name} "
                           "and there is no fallback across platforms")
    return selected, custom_config if custom_config is not None else BACKEND_CONFIGS[selected]()


class Trainer:
    """The training SDK: `Trainer(world_size, model_path, backend_type, custom_config)`, then `init()`.

    The constructor only validates (backend, topology); the RL loop fills in `init()` and the methods that work.
    Extra keyword arguments are kept in `self.options` for the runtime.
    """

    def __init__(self, world_size=1, model_path=None, backend_type=None, custom_config=None, **kwargs):
        check_positive("world_size", world_size)
        if not model_path:
            raise ConfigError("model_path", "is required (a Hugging Face repo id or a local checkpoint folder)")
        self.backend_type, self.config = resolve_backend(backend_type, custom_config)
        if world_size % self.config.tp_size:
            raise ConfigError("world_size", f"{world_size} is not divisible by tp_size {self.config.tp_size}")
        devices = getattr(self.config, "devices", None)
        if devices is not None and len(devices) != world_size:
            raise ConfigError("devices", f"lists {len(devices)} GPUs but world_size is {world_size}")
        self.world_size = world_size
        self.model_path = os.fspath(model_path)
        self.options = dict(kwargs)

    # ---- running -----------------------------------------------------------------------------------------
    def _train_config(self):
        from areno.config import TrainConfig
        from areno.config.applies import check_given

        opts = dict(self.options)
        rt = dict(self.config.runtime)
        fields = {"ckpt": self.model_path, "world_size": self.world_size, "tp_size": self.config.tp_size,
                  "max_running_prompts": self.config.max_running_prompts,
                  "train_devices": getattr(self.config, "devices", None),
                  "rollout_devices": getattr(self.config, "rollout_devices", None),
                  "rollout_tp_size": getattr(self.config, "rollout_tp_size", None), **rt, **opts}
        unknown = sorted(set(opts) - set(TrainConfig.__dataclass_fields__))
        if unknown:
            raise ConfigError(unknown[0], "is not a training option (see `areno train --help` for the names)")
        config = TrainConfig(**{k: v for k, v in fields.items() if k in TrainConfig.__dataclass_fields__})
        # a keyword given where it does not apply (n_samples=4 with algo="sft", ...) is refused as on the command line
        check_given(TrainConfig, vars(config), opts)
        return config

    def init(self):
        """Load the model, tokenizer, optimizer (and the dataset, reward and engine when configured)."""
        from areno.distributed.launch import launched
        from areno.rl.loop import TrainLoop
        from areno.rl.runner import is_rollout_rank, serve_rollout_rank

        config = self._train_config()
        if not launched():  # no folder named: the run's own runs/<time> metrics folder, runs/latest -> it (as the CLI)
            from areno.training.run_dir import default_metrics_folder, link_latest

            config = default_metrics_folder(config)
            link_latest(config)
        ranks = self.world_size + (len(config.rollout_devices) if config.split else 0)
        if ranks > 1 and not launched():
            raise RuntimeError(f"{ranks} ranks from the SDK need one process each: start the script with "
                               f"`torchrun --nproc-per-node {ranks} script.py`, or use `areno train`")
        import torch.distributed as dist

        from areno.distributed import parallel

        # A process group this Trainer makes is its to end (as `areno train` does): left to the interpreter's exit,
        # gloo's threads were sometimes destroyed unjoined ("terminate called without an active exception", a
        # SIGABRT after the script's last line).
        self._owns_group = not dist.is_initialized()
        if is_rollout_rank(config):
            rc = serve_rollout_rank(config)  # a rollout rank serves until the train side closes, then leaves
            if self._owns_group:
                parallel.destroy_distributed()
            raise SystemExit(rc)
        self.loop = TrainLoop(config, sdk=True)  # the loop `areno train` runs (areno.rl.runner.train)
        self.loop.setup()
        return self

    def _require_init(self):
        if getattr(self, "loop", None) is None:
            raise RuntimeError("call Trainer.init() first")
        return self.loop

    @property
    def model(self):
        return self._require_init().model

    @property
    def tokenizer(self):
        return self._require_init().tokenizer

    def generate(self, prompts, sampling_params=None):
        """Roll out: ``prompts`` are strings, chat message lists (with ``image_url`` parts for a model that takes
        images), token-id lists or ``areno.models.multimodal.MultimodalPrompt``; returns, per prompt, a list of
        completions (token ids, log-probs, finish reason, and ``text``: the completion decoded without special tokens,
        or the text before the stop string that ended it) from the colocated engine. An image the model cannot take
        or cannot decode is a ``ValueError`` (``MediaError``) naming it."""
        loop = self._require_init()
        sp = sampling_params or SamplingParams()
        ids = [p if isinstance(p, list) and (not p or isinstance(p[0], int)) or hasattr(p, "input_ids")
               else self._media_prompt(p) or loop.prompt_ids(p) for p in prompts]  # fmt: skip
        out = loop.generate(ids, sp)
        for group in out:
            for c in group:
                if c.text is None:  # the engine sets it only when a stop string cut the output; decode the rest
                    c.text = loop.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return out

    rollout = generate

    def _media_prompt(self, prompt):
        """Chat messages with media parts -> a ``MultimodalPrompt`` (the checkpoint's processor); None otherwise."""
        from areno.models.multimodal import MultimodalProcessor, media_parts

        if not isinstance(prompt, list) or not media_parts(prompt):
            return None
        if getattr(self, "_processor", None) is None:
            self._processor = MultimodalProcessor.from_pretrained(self.model_path)
        return self._processor.encode(prompt)

    def train(self, batch, loss_fn="grpo", mini_bs=1, gradient_accumulation_steps=1, **kwargs) -> dict:
        """Optimizer updates over ``batch`` (rows: `areno.training.batch.Row` or dicts with prompt_ids, response_ids and
        optionally rollout_logprobs / advantage). ``loss_fn`` is "sft", "grpo", "gspo", or a callable
        ``(out, packed, norms) -> (loss, stats)``; ``mini_bs`` rows per microbatch and
        ``gradient_accumulation_steps`` microbatches per update, as on the command line."""
        return self._require_init().train_rows(batch, loss_fn, mini_bs, gradient_accumulation_steps, **kwargs)

    def fit(self) -> dict:
        """The whole `areno train` run: SFT warm-up, held-out evaluation, the steps, the final save."""
        return self._require_init().fit()

    def save_checkpoint(self, path):
        return self._require_init().save(path)

    def close(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.close()
            self.loop = None
        if getattr(self, "_owns_group", False):
            from areno.distributed import parallel

            parallel.destroy_distributed()
            self._owns_group = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"Trainer(world_size={self.world_size}, model_path={self.model_path!r}, "
                f"backend_type={self.backend_type.name}, custom_config={self.config!r})")
