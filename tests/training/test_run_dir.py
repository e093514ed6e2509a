"""The save folder (issue 37): a refused folder is left as it was; a run killed before its first checkpoint reruns;
a preset replaces only its own run; resuming from an earlier step moves the later checkpoints aside; --overwrite
never follows a link; a run without --save-path gets its own metrics folder."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from areno.config import ConfigError
from areno.training import run_dir
from areno.training.checkpoint import latest_checkpoint
from areno.training.run_dir import check, claim, default_metrics_folder, link_latest, retire_after


def checkpoint(folder: Path, step: int) -> Path:
    d = folder / f"step-{step}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text("{}\n")
    return d


def metrics(folder: Path, steps) -> Path:
    (folder / "metrics").mkdir(parents=True, exist_ok=True)
    path = folder / "metrics" / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in steps))
    return path


def test_a_refused_folder_is_left_as_it_was_and_the_refusal_says_what_it_holds(tmp_path):
    out = tmp_path / "out"
    checkpoint(out, 1)
    with pytest.raises(ConfigError, match=r"already holds an earlier run \(step-1\): pass --resume") as e:
        claim(out, resume=False, overwrite=False)
    assert "another run's files" not in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == ["step-1"]  # no new .areno.lock
    with pytest.raises(ConfigError, match="already holds an earlier run"):
        check(out, resume=False, overwrite=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own file")
    with pytest.raises(ConfigError, match=r"holds files that are not an areno run's \(notes.txt\)"):
        claim(mine, resume=False, overwrite=False)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "out" / ".areno.lock").exists()


def test_a_run_killed_before_its_first_checkpoint_is_rerun_and_its_metrics_kept(tmp_path):
    out = tmp_path / "out"
    metrics(out, [1, 2])
    # the killed run's lock: written by a process that is gone (the kernel dropped its flock)
    (out / ".areno.lock").write_text(json.dumps({"pid": 999999999, "host": "h", "started": 0}) + "\n")
    check(out, resume=False, overwrite=False)
    claim(out, resume=False, overwrite=False).release()
    retired = list(out.glob("retired-*/metrics/metrics.jsonl"))
    assert len(retired) == 1 and [json.loads(x)["step"] for x in retired[0].read_text().splitlines()] == [1, 2]
    assert not (out / "metrics").exists()
    assert json.loads((out / ".areno-run.json").read_text())["preset"] is None
    claim(out, resume=False, overwrite=False).release()  # retired metrics alone: still no run to protect


def test_a_preset_replaces_only_its_own_previous_run(tmp_path):
    other = tmp_path / "other"
    checkpoint(other, 4)
    with pytest.raises(ConfigError, match="the quickstart preset did not write .*pass --overwrite"):
        check(other, resume=False, overwrite=True, preset_only="quickstart")
    check(other, resume=False, overwrite=True)  # an explicit --overwrite may
    own = tmp_path / "own"
    claim(own, resume=False, overwrite=True, preset="quickstart").release()
    checkpoint(own, 2)
    check(own, resume=False, overwrite=True, preset_only="quickstart")
    with pytest.raises(ConfigError, match="the agentic-quickstart preset did not write"):
        check(own, resume=False, overwrite=True, preset_only="agentic-quickstart")


def test_resuming_from_an_earlier_step_moves_the_later_checkpoints_and_rows_aside(tmp_path):
    out = tmp_path / "out"
    for n in (1, 2, 3, 4):
        checkpoint(out, n)
    jsonl = metrics(out, [1, 2, 3, 4])
    assert retire_after(out, 4, jsonl) is None  # a resume from the latest moves nothing
    dest = retire_after(out, 2, jsonl)
    assert dest.parent == out and dest.name.startswith("retired-after-step-2-")
    assert sorted(p.name for p in dest.iterdir()) == ["metrics.jsonl", "step-3", "step-4"]
    assert [json.loads(x)["step"] for x in (dest / "metrics.jsonl").read_text().splitlines()] == [3, 4]
    assert latest_checkpoint(out) == out / "step-2"  # the next plain --resume continues the resumed run
    with pytest.raises(ConfigError, match="already holds an earlier run"):
        claim(out, resume=False, overwrite=False)


def test_overwrite_removes_links_without_following_them(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    out = tmp_path / "out"
    checkpoint(out, 1)
    (out / "step-1" / "link").symlink_to(outside / "precious.txt")
    (out / "metrics").symlink_to(outside, target_is_directory=True)
    (out / "step-2").symlink_to(outside, target_is_directory=True)
    claim(out, resume=False, overwrite=True).release()
    assert (outside / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == [".areno-run.json", ".areno.lock"]


def test_overwrite_that_cannot_remove_a_file_is_one_line(tmp_path, monkeypatch):
    out = tmp_path / "out"
    checkpoint(out, 1)

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(run_dir.shutil, "rmtree", refuse)
    with pytest.raises(ConfigError, match=r"--overwrite could not remove .*step-1: Permission denied"):
        claim(out, resume=False, overwrite=True)


@dataclass
class Cfg:
    metrics_dir: str | None = None
    save_path: str | None = None


def test_each_run_without_a_save_path_gets_its_own_folder_and_latest_points_at_the_newest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "latest").mkdir(parents=True)  # left by an older areno
    (tmp_path / "runs" / "latest" / "metrics.jsonl").write_text("{}\n")
    assert default_metrics_folder(Cfg(save_path="x")).metrics_dir is None
    assert default_metrics_folder(Cfg(metrics_dir="m")).metrics_dir == "m"
    a = default_metrics_folder(Cfg())
    link_latest(a)
    # a second run (another process: its own folder even within the same second)
    code = ("import sys; from dataclasses import dataclass; from areno.training.run_dir import *\n"
            "@dataclass\nclass C:\n    metrics_dir: str = None\n    save_path: str = None\n"
            "c = default_metrics_folder(C()); link_latest(c); print(c.metrics_dir)")
    b = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))).stdout.strip()
    assert a.metrics_dir != b and Path(a.metrics_dir).parent == Path(b).parent == Path("runs")
    assert Path(a.metrics_dir).is_dir() and Path(b).is_dir()
    assert os.readlink("runs/latest") == Path(b).name
    earlier = list(Path("runs").glob("earlier-*/metrics.jsonl"))
    assert len(earlier) == 1  # the old folder kept, not mixed into


def test_recover_replaces_a_link_under_the_final_name_without_following_it(tmp_path):
    from areno.training.checkpoint import recover

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    out = tmp_path / "out"
    old = checkpoint(out, 1).rename(out / ".step-1.old-999999999-abcd1234")  # a save killed between its renames
    (out / "step-1").symlink_to(outside, target_is_directory=True)
    assert recover(out) == [out / "step-1"]
    assert not (out / "step-1").is_symlink() and (out / "step-1" / "COMPLETE").is_file() and not old.exists()
    assert (outside / "precious.txt").read_text() == "keep me"
