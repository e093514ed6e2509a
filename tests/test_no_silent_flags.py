"""No silent flags: every `areno train` / `areno serve` / `areno eval` option is read by the run (outside the config
and CLI modules that only parse and validate it), and a flag given on the command line reaches the run (nothing is
parsed and then dropped or refused as "not built"). Whether it matters for the algorithm and mode chosen is each flag's
declaration, checked algorithm x flag by tests/test_flag_applicability.py."""

import dataclasses
import re
from pathlib import Path

import pytest

from areno.cli import main
from areno.config import EvalConfig, ServeConfig, TrainConfig, flag_name
from areno.config.applies import declared
from tests.helpers.flag_context import Files, base_argv, condition_argv, flag_argv

PACKAGE = Path(__file__).resolve().parents[1] / "areno"
# where a flag is parsed, validated and printed: not where it takes effect (config/sampling.py is runtime: the rollout
# builds its SamplingParams there from the flags)
PARSING_ONLY = {"cli.py", *(f"config/{p.name}" for p in (PACKAGE / "config").glob("*.py") if p.name != "sampling.py")}
CLI_ONLY = {"verbose", "preset"}  # flags whose whole effect is in the CLI itself (printing; the preset's base config)
VIA = {"rollout_tp_size": "rollout_tp"}  # read through a TrainConfig property


def runtime_sources() -> dict[str, str]:
    return {path: p.read_text() for p in PACKAGE.rglob("*.py")
            if (path := p.relative_to(PACKAGE).as_posix()) not in PARSING_ONLY}


def readers(name: str, sources: dict[str, str]) -> list[str]:
    """Files that read the field: ``.name`` (config.name, cfg.name) or the string key ``"name"`` (asdict / getattr)."""
    pattern = re.compile(rf"\.{name}\b|[\"']{name}[\"']")
    return [path for path, text in sources.items() if pattern.search(text)]


@pytest.mark.parametrize("cls", [TrainConfig, ServeConfig, EvalConfig], ids=["train", "serve", "eval"])
def test_every_option_is_used_by_the_run(cls):
    sources = runtime_sources()
    silent = [flag_name(f.name) for f in dataclasses.fields(cls)
              if f.name not in CLI_ONLY and not readers(VIA.get(f.name, f.name), sources)]
    cli = {"cli.py": (PACKAGE / "cli.py").read_text()}
    assert all(readers(name, cli) for name in CLI_ONLY if name in {f.name for f in dataclasses.fields(cls)})
    assert not silent, f"parsed and validated but never used by the run: {silent}"


STAND_IN = ("eager_decode", "decode_steps", "kl_estimator")  # a bool, a number and a choice (that needs --kl-coef)


@pytest.mark.parametrize("name", STAND_IN)
def test_a_flag_given_reaches_the_run(name, tmp_path, monkeypatch):
    """Every flag, for every algorithm and in the mode its declaration names: tests/test_flag_applicability.py."""
    monkeypatch.setattr("areno.models.loader.check_model_source", lambda flag, value: None)
    monkeypatch.setattr("areno.models.loader.check_engine_support", lambda flag, value: None)
    seen = []
    monkeypatch.setattr("areno.rl.runner.run_train", lambda config: seen.append(config) or 0)
    files = Files(tmp_path)
    field = TrainConfig.__dataclass_fields__[name]
    argv = [*base_argv("grpo", files), "--metrics-dir", str(tmp_path),
            *condition_argv(declared(field)[1], "grpo", files), *flag_argv(field, files)]
    assert main(argv) == 0
    assert getattr(seen[0], name) != field.default
