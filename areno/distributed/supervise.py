"""The process that reports a run's exit status knows whether the run finished: ``areno train`` runs the run in a
child process it supervises, and every run process (that child, each launched rank) records its orderly exit.

A run process ends in an orderly way (its last step, or an error it printed) through the interpreter's exit, which
writes its record; ``os._exit`` in a reward function or agent, or a signal that kills it, writes none. The supervisor
(and the launcher, for its ranks) turns "ended without a record" into a non-zero exit with one line, even when the
process's own exit code was 0. The supervisor forwards SIGTERM (a scheduler signals it alone) and leaves SIGINT to
the child, which gets a terminal's Ctrl-C itself (the same process group).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from areno.config.env import env_value

STATUS_ENV = "ARENO_RUN_STATUS"  # the folder where every run process records its orderly exit
MAIN = "main"


def die_with_parent() -> None:
    """This process must not outlive the one that started it: if that is killed outright (SIGKILL gives it no chance
    to stop its children), the kernel ends this process too (Linux PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


def record_exit(name: str) -> None:
    """Under a supervisor or launcher (``ARENO_RUN_STATUS`` set): record this process's orderly exit as ``name``."""
    folder = env_value(STATUS_ENV)
    if folder:
        atexit.register(lambda: (Path(folder) / name).touch())


def exited_in_order(name: str) -> bool:
    folder = env_value(STATUS_ENV)
    return bool(folder) and (Path(folder) / name).is_file()


def describe_exit(code: int) -> str:
    """``exited with code 0`` / ``was killed by SIGKILL`` (a Popen return code)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def supervise(argv: list[str]) -> int:
    """Run ``python -m areno argv`` as a child and return its exit status; when the child ended without its record
    (``os._exit``, a signal), say so in one line and exit non-zero (a killing signal is passed on as such)."""
    with tempfile.TemporaryDirectory(prefix="areno-run-") as folder:
        env = dict(os.environ, **{STATUS_ENV: folder})
        child = subprocess.Popen([sys.executable, "-m", "areno", *argv], env=env)

        def forward(signum, frame):
            if signum == signal.SIGTERM:
                child.send_signal(signal.SIGTERM)
            # SIGINT: a terminal's Ctrl-C reaches the child itself (same process group); forwarding it would count twice

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = child.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if (Path(folder) / MAIN).is_file():
            return code
    print(f"areno {argv[0]}: error: the run process {describe_exit(code)} before the run finished (os._exit or a "
          "signal in --reward-fn-path / --agent-fn code, or the system killed it); nothing after the last checkpoint "
          "was saved", file=sys.stderr, flush=True)
    if code < 0:  # killed by a signal: this process ends the same way, so the caller sees which one
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL/SIGSTOP have no handler to reset
            pass
        os.kill(os.getpid(), -code)
    return code or 1


def launch_recorded(module: str, nproc: int, describe, **launch_kw) -> int:
    """``launch.launch`` of ranks that record their orderly exit (``record_exit("rank-N")``): one that ended with
    code 0 but no record (``os._exit`` in user code) fails the run with a line naming it. ``launch_kw``: this node's
    placement and restarts (on several nodes, this node's ranks are whichever the rendezvous gave it)."""
    from areno.distributed.launch import launch

    own = None
    if not env_value(STATUS_ENV):  # where the ranks record their exit (the supervisor's folder, if any)
        own = tempfile.TemporaryDirectory(prefix="areno-ranks-")
        os.environ[STATUS_ENV] = own.name
    try:
        rc = launch(module, [], nproc, describe=describe, **launch_kw)
        placement = launch_kw.get("placement")
        if placement is not None and placement.nnodes > 1:  # this node's ranks are those the rendezvous gave it
            missing = nproc - len(list(Path(env_value(STATUS_ENV)).glob("rank-*"))) if rc == 0 else 0
            if missing > 0:
                print(f"areno: {missing} rank(s) of {placement.describe()} {describe_exit(0)} before the run "
                      "finished (os._exit in --reward-fn-path / --agent-fn code?)", file=sys.stderr, flush=True)
            return 1 if missing > 0 else rc
        vanished = [rank for rank in range(nproc) if not exited_in_order(f"rank-{rank}")] if rc == 0 else []
        for rank in vanished:
            print(f"areno: rank {rank} ({describe(rank)}) {describe_exit(0)} before its run finished (os._exit in "
                  "--reward-fn-path / --agent-fn code?)", file=sys.stderr, flush=True)
        return 1 if vanished else rc
    finally:
        if own is not None:
            os.environ.pop(STATUS_ENV, None)
            own.cleanup()


def as_supervised(argv: list[str]) -> int | None:
    """The ``areno train`` program's entry: in the first process, supervise the run in a child (its exit status);
    in that child, record the orderly exit, end with the supervisor, and return None (run here)."""
    if env_value(STATUS_ENV) is None:
        return supervise(argv)
    die_with_parent()
    record_exit(MAIN)
    return None
