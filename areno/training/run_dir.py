"""The run folder (``--save-path``): one live run at a time, nothing of another run mixed in, writable before work.

``claim(path, resume=..., overwrite=..., preset=...)`` runs on rank 0 before any training:

- it takes an exclusive ``flock`` on ``path/.areno.lock`` (released by the kernel when the process dies, so a killed
  run never leaves a stale lock) and writes the holder's PID, host and command line into it; a second run gets a
  ``ConfigError`` naming the holder's PID;
- it proves the folder writable (the lock file is written and synced), so an unwritable ``--save-path`` fails
  before the first step, not at the first save;
- it puts back a checkpoint that a kill between a save's two renames left under a hidden name (``recover``);
- a folder that already holds anything is refused unless ``--resume`` (continue that run) or ``--overwrite``
  (remove its checkpoints and metrics first), so two runs never interleave their checkpoints; a refused folder is
  left as it was (no new lock file, no new folder). Two exceptions: a folder whose earlier run stopped before its
  first checkpoint (only its metrics, no ``step-N``) is that run's own incomplete start: a plain rerun starts over,
  its metrics moved to ``retired-<time>/``; and a preset that sets ``overwrite`` replaces only a run it made itself
  (``refusal(..., preset_only=NAME)``, checked by the command line before the run).
- it records the run in ``path/.areno-run.json`` (``{"preset", "started", "command"}``): whose folder it is.

``retire_after(save_path, step, metrics_jsonl)`` (a resume from an earlier step) moves the later ``step-N`` folders
and their metrics rows into ``retired-after-step-<step>-<time>/``, so the next plain ``--resume`` cannot pick them
up and nothing is lost. ``default_metrics_folder(config)`` gives a run without ``--save-path`` or ``--metrics-dir``
its own ``runs/<date>-<time>-<pid>``; ``link_latest`` creates it and points ``runs/latest`` at it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from areno.config import ConfigError

log = logging.getLogger("areno.train")

LOCK = ".areno.lock"
RUN = ".areno-run.json"  # who made the folder: {"preset", "started", "command"}
_CHECKPOINTS = re.compile(r"step-\d+|\.step-\d+\.old-.*")  # a tmp folder is no checkpoint
_OURS = re.compile(r"step-\d+|\.step-\d+\..*|metrics|retired-.+")  # what a run writes into its save folder


class RunDir:
    """A claimed save folder; ``release()`` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _holder(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "another process (its PID is not recorded yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"PID {info['pid']} on {info.get('host', '?')} since {since} ({info.get('command', '?')})"


def _in_use(path: Path) -> ConfigError:
    return ConfigError("--save-path", f"{path} is in use by another areno run: {_holder(path / LOCK)}; wait for it "
                       "to end or choose another --save-path")


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def contents(path: Path) -> list[str]:
    """The names in a save folder other than its lock and run record (sorted)."""
    return sorted(p.name for p in path.iterdir() if p.name not in (LOCK, RUN)) if path.is_dir() else []


def made_by(path: Path) -> dict:
    """The run record of ``path`` (``{}`` when there is none or it is unreadable)."""
    try:
        info = json.loads((Path(path) / RUN).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def incomplete_start(names: list[str]) -> bool:
    """Whether a folder holding ``names`` is a run that stopped before its first checkpoint (metrics, no step-N)."""
    return bool(names) and all(_OURS.fullmatch(n) for n in names) and not any(_CHECKPOINTS.fullmatch(n)
                                                                              for n in names)


def refusal(path: Path, names: list[str], *, resume: bool, overwrite: bool, preset_only: str | None = None):
    """Why a run may not start in ``path`` holding ``names`` (None: it may). ``preset_only``: the overwrite comes
    from that preset, not from an explicit ``--overwrite``: it replaces only the preset's own previous run."""
    if resume or not names or incomplete_start(names):
        return None
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    foreign = [n for n in names if not _OURS.fullmatch(n)]
    if preset_only and made_by(path).get("preset") != preset_only:
        return (f"{path} holds files the {preset_only} preset did not write ({shown}): the preset replaces only its "
                "own previous run; pass --overwrite to replace them, --resume to continue that run, or choose "
                "another --save-path")
    if overwrite:
        return None
    if len(foreign) == len(names):
        return (f"{path} holds files that are not an areno run's ({shown}): choose an empty or new folder "
                "(--overwrite would remove only a run's step-N folders and metrics)")
    return (f"{path} already holds an earlier run ({shown}): pass --resume to continue it, --overwrite to replace "
            "it, or choose an empty folder")


def check(path, *, resume: bool, overwrite: bool, preset_only: str | None = None) -> None:
    """The checks ``claim`` makes, read-only (nothing is created): run by the command line before it says where
    the run goes. ``ConfigError`` on ``--save-path`` when the folder is in use or holds what the run may not
    replace."""
    path = Path(path).expanduser().absolute()
    if not path.is_dir():
        return
    try:
        fd = os.open(path / LOCK, os.O_RDONLY)
    except OSError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(path) from None
        finally:
            os.close(fd)
    why = refusal(path, contents(path), resume=resume, overwrite=overwrite, preset_only=preset_only)
    if why:
        raise ConfigError("--save-path", why)


def _lock(path: Path) -> tuple[int, list[Path]]:
    """Create (what is missing of) ``path`` and its lock file and lock it; returns the descriptor and what it
    created (removed again on a refusal)."""
    created = [p for p in (path, *path.parents) if not p.exists()][::-1]
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not (path / LOCK).exists():
            created.append(path / LOCK)
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError("--save-path", f"{path} is not writable: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _in_use(path) from None
    return fd, created


def _undo(created: list[Path]) -> None:
    for p in reversed(created):
        try:
            p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:
            pass


def _remove(target: Path) -> None:
    """Remove what a replaced run left: a link is removed, never followed (nor one inside a folder)."""
    try:
        if target.is_symlink() or not target.is_dir():
            target.unlink()
        else:
            shutil.rmtree(target)
    except OSError as e:
        raise ConfigError("--overwrite", f"could not remove {target}: {e.strerror or e}") from None


def _retire_incomplete(path: Path, names: list[str]) -> None:
    if "metrics" not in names:
        return
    dest = path / f"retired-{_stamp()}"
    dest.mkdir(exist_ok=True)
    os.rename(path / "metrics", dest / "metrics")
    log.warning("%s holds a run that stopped before its first checkpoint: starting over; its metrics are in %s",
                path, dest)


def claim(path, *, resume: bool, overwrite: bool, preset: str | None = None) -> RunDir:
    from areno.training.checkpoint import recover

    path = Path(path).expanduser().absolute()
    fd, created = _lock(path)
    run = RunDir(path, fd)
    try:
        try:
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                    "command": " ".join(sys.argv)}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as e:
            raise ConfigError("--save-path", f"{path} is not writable: {e.strerror or e}") from None
        recover(path)
        names = contents(path)
        why = refusal(path, names, resume=resume, overwrite=overwrite)
        if why:
            raise ConfigError("--save-path", why)
        if overwrite:
            for name in names:
                if _OURS.fullmatch(name):
                    _remove(path / name)
        elif not resume and incomplete_start(names):
            _retire_incomplete(path, names)
        if not resume or not (path / RUN).is_file():
            (path / RUN).write_text(json.dumps({"preset": preset, "started": info["started"],
                                                "command": info["command"]}) + "\n")
    except BaseException:
        run.release()
        _undo(created)
        raise
    return run


def retire_after(save_path, step: int, metrics_jsonl=None) -> Path | None:
    """Move the ``step-N`` folders of ``save_path`` past ``step`` (a resume from an earlier checkpoint), with the
    metrics rows past ``step``, into ``retired-after-step-<step>-<time>/``; returns that folder (None: nothing was
    past ``step``). The rows stay in ``metrics_jsonl`` (the logger drops them on resume)."""
    root = Path(save_path).expanduser().absolute()
    later = sorted((d for d in root.iterdir() if (m := re.fullmatch(r"step-(\d+)", d.name)) and int(m.group(1)) > step),
                   key=lambda d: int(d.name[5:])) if root.is_dir() else []
    if not later:
        return None
    dest = root / f"retired-after-step-{step}-{_stamp()}"
    dest.mkdir(exist_ok=True)
    for d in later:
        os.rename(d, dest / d.name)
    rows = 0
    if metrics_jsonl is not None and Path(metrics_jsonl).is_file():
        from areno.training.metrics import read_lines

        kept = [line for line, rec in read_lines(metrics_jsonl) if rec.get("step", 0) > step]
        rows = len(kept)
        (dest / "metrics.jsonl").write_text("".join(kept), encoding="utf-8")
    log.warning("resuming from step %d: moved %s%s to %s (move them back to return to that run)", step,
                ", ".join(d.name for d in later), f" and {rows} metrics rows past step {step}" if rows else "", dest)
    return dest


_DEFAULT = re.compile(r"\d{8}-\d{6}-\d+")  # runs/<date>-<time>-<pid>


def default_metrics_folder(config):
    """``config`` with its own ``runs/<date>-<time>-<pid>`` metrics folder when it names neither ``--save-path``
    nor ``--metrics-dir`` (so two runs never share one); other configs unchanged. Nothing is created here:
    ``link_latest`` does that when the run starts."""
    if not hasattr(config, "metrics_dir") or config.metrics_dir or config.save_path:
        return config
    from areno.platform import runs_dir

    return dataclasses.replace(config, metrics_dir=str(runs_dir() / f"{_stamp()}-{os.getpid()}"))


def link_latest(config) -> None:
    """Create the run's default metrics folder and point ``runs/latest`` at it (a no-op for a folder the user
    named). A real ``runs/latest`` folder left by an older areno is kept as ``runs/earlier-<time>``."""
    from areno.platform import runs_dir

    folder = Path(getattr(config, "metrics_dir", None) or "")
    runs = runs_dir()
    if folder.parent != runs or not _DEFAULT.fullmatch(folder.name):
        return
    latest, link = runs / "latest", runs / f".latest-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if latest.is_dir() and not latest.is_symlink():
            os.rename(latest, runs / f"earlier-{_stamp()}")
        link.unlink(missing_ok=True)
        link.symlink_to(folder.name)
        os.replace(link, latest)
    except OSError as e:
        raise ConfigError("--metrics-dir", f"the default metrics folder {folder} is not writable ({e.strerror or e}): "
                          "run from a writable folder, or pass --metrics-dir / --save-path") from None
