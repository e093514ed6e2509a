"""README claims: its test command is what CI runs; the quickstart's ranges are the ones tests/quickstart checks and
the story's numbers are the preset's; every flag it names exists; its commands parse; the bring-your-own-data example
runs (on a tiny checkpoint); the reward record's fields are the record's."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text):
    blocks, inside, cur = [], False, []
    for line in text.splitlines():
        if line.startswith("```bash"):
            inside, cur = True, []
        elif line.startswith("```") and inside:
            inside = False
            blocks.append("\n".join(cur).strip())
        elif inside:
            cur.append(line)
    return blocks


def test_readme_opens_with_two_setup_commands_and_ci_runs_the_test_one():
    """The first command installs what training and serving need and runs the quickstart; the second adds the test
    extras and runs the suite, exactly as CI does."""
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    install, tests = blocks[0], blocks[1]
    assert install.startswith("bash scripts/install.sh && ") and "--test" not in install and "\n" not in install
    assert tests.startswith("bash scripts/install.sh --test && ") and "pytest" in tests and "\n" not in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), "the README's test command must be the one .ci/run runs"


# ------------------------------------------------------------------------------------- the quickstart's figures
RANGES = re.compile(r"checks before RL (\d+\.\d)% to (\d+\.\d)%, after RL (\d+\.\d)% to (\d+\.\d)%")


def quickstart_section(text=None) -> str:
    text = text if text is not None else (ROOT / "README.md").read_text()
    start = text.index("## Quickstart")
    return " ".join(text[start : text.index("\n## ", start + 1)].split())


def test_readme_quotes_the_ranges_the_quickstart_test_checks():
    """Per-seed figures differ between CPUs (66.5%, 68.5% and 76.0% for seed 0 on three machines): the README quotes
    the ranges tests/quickstart checks, for the seed it runs, the config's default."""
    from areno.config import TrainConfig
    from tests.quickstart.test_quickstart import AFTER_RL, BEFORE_RL

    section = quickstart_section()
    found = RANGES.findall(section)
    assert len(found) == 1, "the README must quote the quickstart test's before/after ranges once"
    assert tuple(map(float, found[0])) == (*BEFORE_RL, *AFTER_RL)
    assert f"seed {TrainConfig.__dataclass_fields__['seed'].default}, the default" in section


def test_readme_quickstart_describes_the_preset(monkeypatch):
    """The numbers of the story (SFT steps, RL steps, held-out problems, the teacher's error rate, the checkpoint
    name) are the preset's."""
    from areno import presets
    from areno.quickstart import preset, task

    monkeypatch.setattr(preset, "model_path", lambda: Path("model"))  # no model creation
    monkeypatch.setattr(preset, "cpu_threads", lambda: None)  # leave this process's thread count alone
    cfg = presets.get_preset("quickstart")
    section = quickstart_section()
    assert f"SFT warm-up ({cfg.sft_warmup_steps} steps)" in section
    assert f"then {cfg.max_steps} GRPO steps" in section and f"step-{cfg.max_steps}" in section
    assert f"on {task.DEFAULTS['n_eval']} held-out problems" in section
    assert f"carry in {round(100 * task.DEFAULTS['teacher_error'])}% of them" in section
    assert cfg.metrics_dir is None and "runs/quickstart/metrics/metrics.jsonl" in section
    assert cfg.save_path == "runs/quickstart"


# --------------------------------------------------------------------------------------------- flags and commands
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?:-\*)?")
OTHER_TOOLS = {"--index-url", "--dist"}  # pip's, in the GPU install command; pytest-xdist's, in the test one


def _areno_flags() -> set[str]:
    from areno.cli import make_parser
    from areno.config import ServeConfig, TrainConfig

    flags = set()
    for command, options in (("train", TrainConfig), ("serve", ServeConfig)):
        for action in make_parser(command, options)._actions:
            flags.update(action.option_strings)
    from areno.platform.checks import check_parser

    flags.update(o for a in check_parser()._actions for o in a.option_strings)
    usage = (ROOT / "scripts" / "install.sh").read_text()
    flags.update(re.findall(r"^\s+(--[a-z-]+)\)", usage, re.M))  # the installer's options
    return flags


def test_every_flag_the_readme_names_exists():
    known = _areno_flags() | OTHER_TOOLS
    assert {"--test", "--dry-run", "--world-size", "--port"} <= known
    missing = set()
    for flag in FLAG.findall((ROOT / "README.md").read_text()):
        if flag.endswith("-*"):  # a family, e.g. --unfreeze-mm-*
            if not any(k.startswith(flag[:-1]) for k in known):
                missing.add(flag)
        elif flag not in known:
            missing.add(flag)
    assert not missing, f"the README names flags no command has: {sorted(missing)}"


def _commands(text: str, prefix: str) -> list[list[str]]:
    """The README's bash commands that start with ``prefix``, continuation lines joined, as argv lists."""
    import shlex

    joined = (" ".join(block.replace("\\\n", " ").split()) for block in _bash_blocks(text))
    return [shlex.split(command) for command in joined if command.startswith(prefix)]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from areno.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("readme") / "ckpt", family="qwen3", seed=0)


def test_the_readmes_train_commands_parse(tiny_ckpt, tmp_path, monkeypatch):
    """Every `areno train` command of the README is a valid configuration (the hub checkpoint swapped for a tiny
    local one; the data files of the own-data example written first)."""
    from areno.cli import make_parser, parse_config
    from areno.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text(_own_data()[0])
    (tmp_path / "reward.py").write_text(_own_data()[1])
    for name in ("dataset_loader.py", "math_verify_reward.py"):
        (tmp_path / "examples" / "math").mkdir(parents=True, exist_ok=True)
        (tmp_path / "examples" / "math" / name).write_text((ROOT / "examples" / "math" / name).read_text())
    commands = _commands((ROOT / "README.md").read_text(), "areno train --ckpt")
    assert len(commands) >= 3, commands  # GSM8K on one GPU, on a node, the own-data example
    for argv in commands:
        argv = [str(tiny_ckpt) if a == "Qwen/Qwen3-0.6B" else a for a in argv[2:]]
        cfg = parse_config(make_parser("train", TrainConfig), TrainConfig, argv)
        assert cfg.ckpt == str(tiny_ckpt)


# ------------------------------------------------------------------------------------------------ your own data
def _own_data() -> tuple[str, str, list[str]]:
    """The README's own-data example: the data.jsonl rows, reward.py, and the command's argv."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Your own data")
    section = text[start : text.index("\n## ", start + 1)]
    rows = section.split("```json\n", 1)[1].split("```", 1)[0]
    reward = section.split("```python\n", 1)[1].split("```", 1)[0]
    (argv,) = _commands(section, "areno train")
    return rows, reward, argv


def test_the_own_data_example_runs(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """The README's rows, reward and command, as written, on a tiny checkpoint for one short step."""
    from areno.cli import main

    rows, reward, argv = _own_data()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text(rows)
    (tmp_path / "reward.py").write_text(reward)
    assert argv[:2] == ["areno", "train"] and "Qwen/Qwen3-0.6B" in argv
    argv = [str(tiny_ckpt) if a == "Qwen/Qwen3-0.6B" else a for a in argv[1:]]
    small = ["--max-steps", "1", "--n-samples", "2", "--mini-bs", "4", "--max-new-tokens", "4", "--dtype", "float32"]
    assert main([*argv, *small, "--no-tensorboard"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy: before RL" in out  # the "split": "eval" row is held out
    assert (tmp_path / "runs" / "mine" / "step-1" / "config.json").exists()


def test_the_readme_explains_prompts_and_the_reward_record():
    from dataclasses import fields

    from areno.rl.rewards import RewardRecord

    text = " ".join((ROOT / "README.md").read_text().split())
    assert "a list of chat messages goes through the checkpoint's chat template" in text
    assert "a string is raw text, tokenized as it is, with no template" in text
    record = text[text.index("The reward record:") :].split(". It returns")[0]
    for f in fields(RewardRecord):
        assert f"`{f.name}`" in record, f"the README's reward record misses {f.name}"
    assert "`source .venv/bin/activate`" in text


def test_the_supported_models_table_is_the_registrys():
    """The README's table is `areno check --models` (generated from each adapter's ModelCard): it lists every
    registered model type and cannot drift from the code."""
    from areno.models.registry import load_builtin, supported_models_table

    text = (ROOT / "README.md").read_text()
    start, end = "<!-- generated: areno check --models -->\n", "<!-- end generated -->"
    assert start in text and end in text
    table = text[text.index(start) + len(start): text.index(end)]
    assert table == supported_models_table(), "regenerate the README's table with `areno check --models`"
    assert all(f"`{t}`" in table for t in load_builtin())
