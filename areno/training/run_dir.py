"""The run folder (``--save-path``): one live run at a time, nothing of another run mixed in, writable before work.

``claim(path, resume=..., overwrite=...)`` runs on rank 0 before any training:

- it takes an exclusive ``flock`` on ``path/.areno.lock`` (released by the kernel when the process dies, so a killed
  run never leaves a stale lock) and writes the holder's PID, host and command line into it; a second run gets a
  ``ConfigError`` naming the holder's PID;
- it proves the folder writable (the lock file is written and synced), so an unwritable ``--save-path`` fails
  before the first step, not at the first save;
- it puts back a checkpoint that a kill between a save's two renames left under a hidden name (``recover``);
- a folder that already holds anything is refused unless ``--resume`` (continue that run) or ``--overwrite``
  (remove its checkpoints and metrics first), so two runs never interleave their checkpoints.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from areno.config import ConfigError

LOCK = ".areno.lock"
_OURS = re.compile(r"step-\d+|\.step-\d+\..*|metrics")  # what a run writes into its save folder


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


def claim(path, *, resume: bool, overwrite: bool) -> RunDir:
    from areno.training.checkpoint import recover

    path = Path(path).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError("--save-path", f"{path} is not writable: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError("--save-path", f"{path} is in use by another areno run: {_holder(path / LOCK)}; wait for "
                          "it to end or choose another --save-path") from None
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        raise ConfigError("--save-path", f"{path} is not writable: {e.strerror or e}") from None
    run = RunDir(path, fd)
    try:
        recover(path)
        others = sorted(p.name for p in path.iterdir() if p.name != LOCK)
        if others and not resume and not overwrite:
            shown = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6 else "")
            raise ConfigError("--save-path", f"{path} already holds another run's files ({shown}): pass --resume to "
                              "continue that run, --overwrite to replace it, or choose an empty folder")
        if overwrite:
            for name in others:
                if _OURS.fullmatch(name):
                    target = path / name
                    shutil.rmtree(target) if target.is_dir() else target.unlink()
    except BaseException:
        run.release()
        raise
    return run
