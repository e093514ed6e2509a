"""A run's own timeout for a silent rank: each rank of a multi-process run beats in the run's store once a second;
train rank 0 watches every other rank and the others watch rank 0, so a stopped (SIGSTOP) or hung process ends the
run after ``ARENO_RANK_TIMEOUT_S`` seconds (300) with one line naming it, not torch's 30-minute collective timeout.

The beats come from a thread, so a rank busy in a long step (kernels, a collective) still beats; only a process
that no longer runs at all falls silent. A rank that ends in order says so first (``close``), so the others do not
mistake its exit for silence.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from areno.config import ConfigError
from areno.config.env import env_value

PREFIX = "areno/rank-watch/"
TIMEOUT_ENV = "ARENO_RANK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


def rank_timeout_s() -> float:
    """``ARENO_RANK_TIMEOUT_S`` (seconds >= 0; 0: no timeout), 300 when unset."""
    raw = env_value(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(TIMEOUT_ENV, f"must be seconds >= 0 (0: no timeout), got {raw!r}")
    return value


def describe_rank(config, rank: int) -> str:
    """``train rank 0 on GPU 2`` / ``rollout engine 1 rank 0 on GPU 5`` (process slots on a CPU host)."""
    where = "GPU" if torch.cuda.is_available() else "CPU slot"
    if rank < config.world_size:
        device = config.train_devices[rank] if config.train_devices else rank
        return f"train rank {rank} on {where} {device}"
    j = rank - config.world_size
    return (f"rollout engine {j // config.rollout_tp} rank {j % config.rollout_tp} on {where} "
            f"{config.rollout_devices[j]}")


class Watchdog:
    """Beats for this rank and watches the others (see the module doc); ``describe(rank)`` names a rank."""

    def __init__(self, timeout_s: float, describe, *, interval_s: float = 1.0):
        self.timeout_s, self.describe, self.interval_s = timeout_s, describe, interval_s
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.watched = list(range(1, world)) if self.rank == 0 else [0]
        self.store = dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())
        self.store.set(f"pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="areno-rank-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """This rank ends in order: stop beating and tell the watchers."""
        if not self._done.is_set():
            self._done.set()
            with contextlib.suppress(RuntimeError, OSError):  # no store left: no watcher left either
                self.store.set(f"done/{self.rank}", "1")

    def _run(self) -> None:
        seen = {r: (None, time.monotonic()) for r in self.watched}
        while not self._done.wait(self.interval_s):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                for r in self.watched:
                    beats = self.store.add(f"beat/{r}", 0)
                    if beats != seen[r][0]:
                        seen[r] = (beats, now)
                    elif now - seen[r][1] > self.timeout_s and not self.store.check([f"done/{r}"]):
                        if not self._done.is_set():
                            self._end_run(r, now - seen[r][1])
            except (RuntimeError, OSError):  # the store went away: the launcher is ending the run anyway
                return

    def _end_run(self, silent: int, seconds: float) -> None:
        """Name the silent rank, stop it if it runs on this host (a stopped process ignores the launcher's SIGTERM),
        and end this process: the launcher then stops the others."""
        if self.rank in (0, 1):  # one line: rank 0 names any silent rank, rank 1 a silent rank 0
            print(f"areno train: error: rank {silent} ({self.describe(silent)}) has not answered for {seconds:.0f} s "
                  f"(stopped or hung; {TIMEOUT_ENV}={self.timeout_s:g}): ending the run", file=sys.stderr,
                  flush=True)
        try:
            host, pid = self.store.get(f"pid/{silent}").decode().split()
            if host == socket.gethostname():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, RuntimeError):
            pass
        os._exit(1)


def watch_ranks(cfg):
    """A ``Watchdog`` for this rank of a multi-process run (``cfg``: its TrainConfig, to name ranks); None with one
    process or ``ARENO_RANK_TIMEOUT_S=0``."""
    timeout = rank_timeout_s()
    if not dist.is_initialized() or dist.get_world_size() == 1 or not timeout:
        return None
    return Watchdog(timeout, lambda rank: describe_rank(cfg, rank))
