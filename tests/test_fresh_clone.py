"""The suite passes on a fresh clone of the repository alone.

A checkout here may sit beside ``../shared`` (the full GSM8K copy, baselines); a newcomer's clone does not. This test
clones the committed repository into a temporary folder with nothing beside it, then, with the clone first on the
import path, collects the whole suite there and runs the GSM8K tests: nothing may error or fail for lack of shared
data, and the tests that need the full data set skip saying why. (It checks what is committed: uncommitted files are
not in a clone.)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GSM8K_TESTS = ["tests/test_examples_math.py", "tests/rl/test_gsm8k_e2e.py"]

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(),
    reason="needs git and a git checkout of the repository to clone",
)


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    parent = tmp_path_factory.mktemp("fresh")
    dest = parent / "areno"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(dest)], check=True, timeout=120)
    assert sorted(p.name for p in parent.iterdir()) == ["areno"]  # no ../shared beside the clone
    return dest


def _pytest(clone, *args, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(clone), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_clone_imports_its_own_areno(clone):
    env = dict(os.environ, PYTHONPATH=str(clone))
    out = subprocess.run([sys.executable, "-c", "import areno; print(areno.__file__)"], cwd=clone, env=env,
                         capture_output=True, text=True, check=True, timeout=120)
    assert Path(out.stdout.strip()).resolve().is_relative_to(clone.resolve())


@pytest.fixture(scope="module")
def suite_run(clone):
    """One pytest process in the clone: it collects the whole suite (a module that cannot be imported there is a
    collection error) and runs the GSM8K tests alone (the rest deselected)."""
    modules = " or ".join(Path(t).name for t in GSM8K_TESTS)
    res = _pytest(clone, "-rs", "tests", "-k", modules, timeout=900)
    return res.returncode, res.stdout + res.stderr


def test_the_whole_suite_collects_in_a_fresh_clone(suite_run):
    code, out = suite_run
    assert code == 0, out[-4000:]
    collected = next(line for line in out.splitlines() if line.startswith("collected "))
    assert "deselected" in collected and "error" not in collected, out[-4000:]  # "collected N items / M deselected"
    assert not [line for line in out.splitlines() if line.startswith(("ERROR", "E   "))], out[-4000:]
    assert "tests/test_examples_math.py " in out and "tests/rl/test_gsm8k_e2e.py " in out


def test_the_gsm8k_tests_pass_in_a_fresh_clone(suite_run):
    code, out = suite_run
    assert code == 0, out[-4000:]
    summary = out.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary and "error" not in summary, out[-4000:]
    # the fixture rows ran; only the full-data runs skipped, each saying why
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all("needs the full GSM8K set" in line and "github.com/openai/grade-school-math" in line
                           for line in skipped), out[-4000:]
