"""The building blocks of the configs: `opt()` fields and their `--help` groups, flag names, the argument types and the
`check_*` helpers shared by the config sections, ServeConfig and the SDK; `ConfigError` / `RunError`."""

import os
import re
from dataclasses import field, fields

from areno.config.constants import OFFLOAD_MODES

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
    """A config field: default, help text, `--help` group and any extra argparse metadata; ``algos=`` (the
    algorithms it applies to; all if absent) and ``needs=`` (a condition of ``areno.config.applies.CONDITIONS``)
    declare where it applies."""
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


def check_bool(name, value):
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be True or False, got {value!r}")


def check_positive(name, value, *, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name, value, low):
    if not is_int(value) or value < low:
        raise ConfigError(name, f"must be an integer >= {low}, got {value!r}")


def check_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, f"must be a number, got {value!r}")


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


def check_media_limits(config) -> None:
    """The image caps of the message schema (``MediaLimits``), shared by train and serve."""
    check_sizes(config, ("max_image_bytes", "max_image_pixels", "max_images_per_prompt"))
