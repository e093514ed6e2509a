"""Named presets for `areno train --preset NAME`.

A preset is an ordinary function returning a complete, valid `TrainConfig`; register it with `@register_preset`.
On the command line the preset is the starting point and every flag given explicitly overrides its field.
The module holding a preset registers it when imported; `_BUILTIN` lists the modules imported on first lookup, so
the registry stays cheap to import.
"""

import importlib
from collections.abc import Callable

from areno.config import ConfigError, TrainConfig

PRESETS: dict[str, Callable[[], TrainConfig]] = {}

# Modules that register built-in presets when imported.
_BUILTIN: tuple[str, ...] = ("areno.quickstart.preset", "areno.quickstart.agentic")


def register_preset(name: str):
    """Decorator: `@register_preset("quickstart")` over a function `() -> TrainConfig`."""

    def wrap(fn: Callable[[], TrainConfig]):
        PRESETS[name] = fn
        return fn

    return wrap


def _load_builtin():
    for module in _BUILTIN:
        importlib.import_module(module)


def preset_names() -> list[str]:
    _load_builtin()
    return sorted(PRESETS)


def get_preset(name: str) -> TrainConfig:
    """The preset's config; `ConfigError` on `--preset` for an unknown name, listing the known ones."""
    _load_builtin()
    if name not in PRESETS:
        known = ", ".join(sorted(PRESETS)) or "none are registered in this build"
        raise ConfigError("--preset", f"names an unknown preset {name!r}; known presets: {known}")
    config = PRESETS[name]()
    if not isinstance(config, TrainConfig):
        raise TypeError(f"preset {name!r} returned {type(config).__name__}, not a TrainConfig")
    return config
