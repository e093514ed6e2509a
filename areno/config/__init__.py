"""The run configurations (`TrainConfig`, `ServeConfig`, `EvalConfig`), `SamplingParams` and their errors; the section
modules, `fields` (opt, flag names, checks), `constants` and `env` (the ARENO_* table) are imported by name."""

from areno.config.evaluate import EvalConfig
from areno.config.fields import GROUPS, ConfigError, RunError, flag_name, format_config
from areno.config.sampling import SamplingParams
from areno.config.serve import ServeConfig
from areno.config.train import TrainConfig

__all__ = ["GROUPS", "ConfigError", "EvalConfig", "RunError", "SamplingParams", "ServeConfig", "TrainConfig",
           "flag_name", "format_config"]
