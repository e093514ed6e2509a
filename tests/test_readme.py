"""The README's test command is what CI runs: keep .ci/run and the README in step; the quickstart's figures are the
measured seeds' and the story's numbers are the preset's."""

import re
from pathlib import Path

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
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    install, tests = blocks[0], blocks[1]
    assert install.startswith("bash scripts/install.sh") and "\n" not in install
    assert "pytest" in tests and "\n" not in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), "the README's test command must be the one .ci/run runs"


# ------------------------------------------------------------------------------------- the quickstart's figures
# "seed 0 (the default) 66.5% -> 99.5%": one figure per measured seed; "before RL 64.0% to 69.0%": a stated range.
SEED_FIGURE = re.compile(r"seed (\d+)( \(the default\))? (\d+(?:\.\d)?)% -> (\d+(?:\.\d)?)%")
RANGE = re.compile(r"(before|after) RL (\d+(?:\.\d)?)% to (\d+(?:\.\d)?)%")
COMMAND = "areno train --preset quickstart --seed N"


def quickstart_section(text=None) -> str:
    text = text if text is not None else (ROOT / "README.md").read_text()
    start = text.index("## Quickstart")
    return " ".join(text[start : text.index("\n## ", start + 1)].split())


def quickstart_figures(text=None) -> dict:
    """The held-out accuracy figures the README quotes for the quickstart: per seed (seed, before, after) with the
    default seed first, and the stated before/after ranges over them."""
    section = quickstart_section(text)
    seeds = [(int(s), float(b), float(a), bool(d)) for s, d, b, a in SEED_FIGURE.findall(section)]
    ranges = {f"{which}_range": (float(lo), float(hi)) for which, lo, hi in RANGE.findall(section)}
    assert seeds and set(ranges) == {"before_range", "after_range"}, "the README's quickstart figures are missing"
    default = [s for s, _, _, d in seeds if d]
    return {"seeds": [s for s, _, _, _ in seeds], "default": default, "figures": {s: (b, a) for s, b, a, _ in seeds},
            **ranges}


def test_readme_quickstart_figures_are_the_measured_seeds_and_their_range():
    """Each measured seed is quoted with the command that measures it, the default seed is the config's default,
    and the stated ranges are exactly those of the per-seed figures (tests/quickstart runs the default seed and
    checks it lies in them)."""
    from areno.config import TrainConfig

    q = quickstart_figures()
    section = quickstart_section()
    assert COMMAND in section
    assert q["seeds"] == list(range(len(q["seeds"]))) and len(q["seeds"]) >= 3, q["seeds"]
    assert q["default"] == [TrainConfig.__dataclass_fields__["seed"].default] == [q["seeds"][0]]
    befores = [b for b, _ in q["figures"].values()]
    afters = [a for _, a in q["figures"].values()]
    assert q["before_range"] == (min(befores), max(befores)) and q["after_range"] == (min(afters), max(afters))
    # 200 held-out problems: every figure is a multiple of 0.5%
    assert all((2 * x) == int(2 * x) for x in befores + afters)


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
