"""No silent flags: every `areno train` / `areno serve` option is either read by the run (outside the config and CLI
modules that only parse and validate it) or refused with exit 2 naming it, because its feature is not built."""

import dataclasses
import re
from pathlib import Path

import pytest

from areno.cli import main
from areno.config import NOT_BUILT, ServeConfig, TrainConfig, flag_name

PACKAGE = Path(__file__).resolve().parents[1] / "areno"
PARSING_ONLY = {"config.py", "cli.py"}  # where a flag is parsed, validated and printed: not where it takes effect
CLI_ONLY = {"verbose", "preset"}  # flags whose whole effect is in the CLI itself (printing; the preset's base config)
VIA = {"rollout_tp_size": "rollout_tp"}  # read through a TrainConfig property


def runtime_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py") if p.name not in PARSING_ONLY}


def readers(name: str, sources: dict[str, str]) -> list[str]:
    """Files that read the field: ``.name`` (config.name, cfg.name) or the string key ``"name"`` (asdict / getattr)."""
    pattern = re.compile(rf"\.{name}\b|[\"']{name}[\"']")
    return [path for path, text in sources.items() if pattern.search(text)]


@pytest.mark.parametrize("cls", [TrainConfig, ServeConfig], ids=["train", "serve"])
def test_every_option_is_used_by_the_run_or_refused(cls):
    sources = runtime_sources()
    silent = [flag_name(f.name) for f in dataclasses.fields(cls)
              if f.name not in NOT_BUILT.keys() | CLI_ONLY and not readers(VIA.get(f.name, f.name), sources)]
    cli = {"cli.py": (PACKAGE / "cli.py").read_text()}
    assert all(readers(name, cli) for name in CLI_ONLY if name in {f.name for f in dataclasses.fields(cls)})
    assert not silent, f"parsed and validated but never used by the run: {silent}"
    # a refused flag is refused because nothing reads it: once something does, it leaves NOT_BUILT
    built = [flag_name(n) for n in NOT_BUILT if n in {f.name for f in dataclasses.fields(cls)} and readers(n, sources)]
    assert not built, f"used by the run but still refused as not built: {built}"


def non_default_value(f: dataclasses.Field) -> list[str]:
    if f.type is bool:
        return [flag_name(f.name)]
    choices = f.metadata.get("choices")
    if choices:
        return [flag_name(f.name), next(c for c in choices if c != f.default)]
    return [flag_name(f.name), "2"]


# every feature of this build is built: the refusal is exercised with a stand-in entry for a real flag
STAND_IN = {"eager_decode": "stand-in: a feature that is not built"}


@pytest.mark.parametrize("name", sorted(NOT_BUILT or STAND_IN))
def test_flags_of_unbuilt_features_exit_2_naming_the_flag_and_why(name, capsys, tmp_path, monkeypatch):
    if not NOT_BUILT:
        monkeypatch.setitem(NOT_BUILT, name, STAND_IN[name])
    monkeypatch.setattr("areno.models.loader.check_model_source", lambda flag, value: None)
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_fn(record):\n    return 0.0\n")
    field = TrainConfig.__dataclass_fields__[name]
    argv = ["train", "--ckpt", "m", "--dataset-path", "d.jsonl", "--reward-fn-path", str(reward),
            *non_default_value(field)]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"areno train: error: {flag_name(name)} {NOT_BUILT[name]}" in err
