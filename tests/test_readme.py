"""The README's test command is what CI runs: keep .ci/run and the README in step."""

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
