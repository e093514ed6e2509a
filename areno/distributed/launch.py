"""Launch ``--world-size`` ranks through torch's own elastic launcher (``torch.distributed.run``).

``areno train --world-size N`` on one node re-runs the same module under the launcher with N processes; on several
nodes, run ``torchrun --nnodes ... --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m areno.train ...`` yourself: a
process that already sees ``RANK``/``WORLD_SIZE`` never launches again.
"""

from __future__ import annotations

import os
import socket
import sys


def launched() -> bool:
    """True inside a torchrun/elastic worker (or a single process that needs no launch)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module: str, argv: list[str], nproc: int, *, stop_is_success: bool = False, describe=None) -> int:
    """Run ``python -m module argv`` on ``nproc`` local ranks with torch.distributed.run; returns the exit code.

    A SIGTERM/SIGINT reaches the ranks through the launcher; with ``stop_is_success`` (a server) that is a normal
    stop (exit 0), otherwise the exit code says which signal ended the run. A rank that dies takes the others down
    with it (the launcher stops them); the message names it, with ``describe(rank)`` (its role and device).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args([
        "--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--module", module, *argv,
    ])
    try:
        run(args)
    except SignalException as exc:
        return 0 if stop_is_success else 128 + int(exc.sigval)
    except Exception as exc:  # ChildFailedError: the failing rank's error is already printed
        failures = getattr(exc, "failures", None) or {}
        for rank, failure in sorted(failures.items()):
            code = getattr(failure, "exitcode", None)
            how = (f"was killed by {failure.signal_name()}" if code is not None and code < 0 and
                   hasattr(failure, "signal_name") else f"exited with code {code}")
            who = f" ({describe(rank)})" if describe is not None else ""
            print(f"areno: rank {rank}{who} {how}; the other ranks were stopped", file=sys.stderr)
        if not failures:
            print(f"areno: a rank failed: {exc}", file=sys.stderr)
        return 1
    return 0
