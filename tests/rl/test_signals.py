"""Stopping and vanishing (issue 37, points 8 and 9): a scheduler's SIGTERM or a Ctrl-C saves a checkpoint at the next
step boundary and exits non-zero with one line (colocated, split mode, launched ranks), and --resume continues; a run
process that ends through os._exit in a reward function or agent exits non-zero with one line, never 0."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.split_runs import ROOT, env  # the split tests' `files` (tiny checkpoint, data): tests/rl/conftest.py


@pytest.fixture(scope="module")
def plugins(files, tmp_path_factory):  # noqa: F811
    """The split tests' checkpoint and data, with a reward function that calls os._exit(0) at call EXIT_AT_CALL,
    takes REWARD_SLEEP_S seconds a call and appends a byte a call to REWARD_LOG."""
    reward = tmp_path_factory.mktemp("signals") / "reward.py"
    reward.write_text("import os, time\ncalls = [0]\n"
                      "def reward_fn(record):\n"
                      "    calls[0] += 1\n"
                      "    if os.environ.get('REWARD_LOG'):\n"
                      "        with open(os.environ['REWARD_LOG'], 'a') as f:\n"
                      "            f.write('x')\n"
                      "    time.sleep(float(os.environ.get('REWARD_SLEEP_S', '0')))\n"
                      "    if os.environ.get('EXIT_AT_CALL') and calls[0] == int(os.environ['EXIT_AT_CALL']):\n"
                      "        os._exit(0)\n"
                      "    return float(len(record.completion) % 3 == 0)\n")
    return files[0], files[1], reward


def argv(plugins, out, *extra, steps=200):
    ckpt, data, reward = plugins
    return [sys.executable, "-m", "areno", "train", "--ckpt", str(ckpt), "--dataset-path", str(data),
            "--reward-fn-path", str(reward), "--batch-size", "2", "--n-samples", "2", "--mini-bs", "2", "--max-steps",
            str(steps), "--max-new-tokens", "4", "--save-path", str(out), "--save-interval", "1000", "--lr", "1e-3",
            "--no-tensorboard", "--dtype", "float32", *extra]


def steps_logged(out: Path) -> int:
    path = out / "metrics" / "metrics.jsonl"
    return len([x for x in path.read_text().splitlines() if '"step"' in x]) if path.is_file() else 0


def signal_after_first_step(plugins, out, send, *extra, timeout=240, **env_extra):
    """Start a long run, wait for its first logged step, ``send(proc)``; returns (exit code, stderr)."""
    proc = subprocess.Popen(argv(plugins, out, *extra), env=env(**env_extra), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while steps_logged(out) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        send(proc)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def assert_saved_and_stopped(out: Path, code: int, err: str, signame: str):
    assert code == 128 + signal.Signals[signame].value, err[-3000:]
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("step-*"))
    n = steps_logged(out)
    assert saved == [n] and 1 <= n < 200, (saved, n)  # the step it stopped at, saved (--save-interval is 1000)
    last = err.strip().splitlines()[-1]
    assert last == f"areno train: stopped by {signame} after step {n}: saved at {out / f'step-{n}'} (--resume " \
                   "continues from there)", err[-3000:]
    assert "Traceback" not in err
    return n


@pytest.mark.slow  # two runs
def test_sigterm_to_areno_train_saves_at_the_step_boundary_and_resume_continues(plugins, tmp_path):
    out = tmp_path / "run"
    code, err = signal_after_first_step(plugins, out, lambda p: os.kill(p.pid, signal.SIGTERM))  # as Kubernetes does
    n = assert_saved_and_stopped(out, code, err, "SIGTERM")
    proc = subprocess.run(argv(plugins, out, "--resume", steps=n + 1), env=env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert steps_logged(out) == n + 1


@pytest.mark.slow  # two runs
def test_ctrl_c_saves_and_a_second_one_stops_at_once(plugins, tmp_path):
    out = tmp_path / "run"
    code, err = signal_after_first_step(plugins, out, lambda p: os.killpg(p.pid, signal.SIGINT))  # the terminal's
    assert_saved_and_stopped(out, code, err, "SIGINT")

    calls = tmp_path / "reward-calls"  # one byte a reward call: a step scores 2 x 2 samples, one after another

    def twice(p):  # as a person presses it: the second well after the first, within the same (slowed) step
        deadline = time.monotonic() + 120
        while (calls.stat().st_size if calls.exists() else 0) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)  # inside step 2's rewards (its second call: >= 1.5 s of them left), not at a boundary
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(0.5)
        os.killpg(p.pid, signal.SIGINT)

    out = tmp_path / "twice"
    code, err = signal_after_first_step(plugins, out, twice, REWARD_SLEEP_S="0.5", REWARD_LOG=str(calls))
    assert code == 130 and err.strip().splitlines()[-1].startswith("areno train: stopped at once by a second Ctrl-C")
    assert not list(out.glob("step-*"))


@pytest.mark.parametrize("extra", [[], ["--train-devices", "0", "--rollout-devices", "1"], ["--world-size", "2"]],
                         ids=["colocated", "split", "two-ranks"])
def test_a_scheduler_sigterm_to_every_process_saves_once(plugins, tmp_path, extra):
    """Slurm signals every process of the job: the launcher, the train ranks, the rollout ranks."""
    out = tmp_path / "run"
    code, err = signal_after_first_step(plugins, out, lambda p: os.killpg(p.pid, signal.SIGTERM), *extra)
    assert_saved_and_stopped(out, code, err, "SIGTERM")


AGENT = """
import os
async def run_agent(ctx, batch):
    os._exit(0)
"""


@pytest.mark.parametrize("plugin", ["reward", "agent", "reward-two-ranks"])
def test_os_exit_in_user_code_is_not_a_successful_run(plugins, tmp_path, plugin):
    out = tmp_path / "run"
    extra = ["--world-size", "2"] if plugin == "reward-two-ranks" else []
    if plugin == "agent":
        agent = tmp_path / "agent.py"
        agent.write_text(AGENT)
        extra = ["--agent-fn", str(agent)]
    proc = subprocess.run(argv(plugins, out, *extra, steps=3), env=env(EXIT_AT_CALL="3"), cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "exited with code 0 before" in last and "run finished" in last, proc.stderr[-3000:]


def test_a_bad_rank_timeout_is_one_line_exit_2(plugins, tmp_path, monkeypatch, capsys):
    from areno.cli import main

    monkeypatch.setenv("ARENO_RANK_TIMEOUT_S", "soon")
    assert main(argv(plugins, tmp_path / "run", "--world-size", "2")[3:]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["areno train: error: ARENO_RANK_TIMEOUT_S must be seconds >= 0 (0: no timeout), got 'soon'"]
