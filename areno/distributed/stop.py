"""Stopping a run on SIGTERM/SIGINT: the handler records the request, the loop saves and stops at a step boundary."""

from __future__ import annotations

import signal
import sys
import threading

import torch
import torch.distributed as dist

from areno.config import RunError
from areno.distributed.parallel import env_rank

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(RunError):
    """The run stopped on a signal at a step boundary (after saving): exit ``128 + signum`` with one line."""

    def __init__(self, signum: int, message: str):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(message)


class StopRequest:
    """SIGTERM/SIGINT handlers that only record the first signal (``signum``); ``hard``: a second SIGINT raises
    KeyboardInterrupt (stop at once). A launched rank is not hard: its launcher forwards the terminal's Ctrl-C, so
    one keypress arrives twice, and the launcher ends the ranks itself. ``quiet``: print nothing (ranks > 0)."""

    def __init__(self, *, hard: bool = True, quiet: bool = False):
        self.signum: int | None = None
        self.hard, self.quiet = hard, quiet
        self._previous: dict = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            if not self.quiet:
                again = " (Ctrl-C again stops at once, unsaved)" if self.hard else ""
                print(f"areno: {signal.Signals(signum).name} received: the run saves and stops at the end of this "
                      f"step{again}", file=sys.stderr, flush=True)
        elif signum == signal.SIGINT and self.hard:
            raise KeyboardInterrupt

    def agreed(self, group=None) -> int:
        """The signal every rank of ``group`` (None: the whole world) stops on: any rank's (0: none). A collective
        where several ranks run, so they all stop at the same step."""
        code = self.signum or 0
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            t = torch.tensor([code], dtype=torch.int64, device="cuda" if torch.cuda.is_available() else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            code = int(t.item())
        return code


def is_rank_zero() -> bool:
    return env_rank() == 0
