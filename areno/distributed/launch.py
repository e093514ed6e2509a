"""Launch ``--world-size`` ranks through torch's own elastic launcher (``torch.distributed.run``).

``areno train --world-size N`` on one node re-runs the same module under the launcher with N processes; on several
nodes (Slurm, Kubeflow's PyTorchJob, SkyPilot or ``--nnodes``: see cluster.py) each node's launcher joins the c10d
rendezvous on node 0, and ``--max-restarts`` lets the agent re-form the group when a rank dies. A process that
already sees ``RANK``/``WORLD_SIZE`` from torch's agent (or a task-level launcher) never launches again.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from contextlib import contextmanager


def launched() -> bool:
    """True inside a torchrun/elastic worker or a rank a launcher started (a node-level launcher's own RANK, as
    Kubeflow's PyTorchJob sets it, names the node: not launched yet)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    from areno.distributed.cluster import detect

    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and detect() is None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def stop_once():
    """The launcher stops once however many SIGTERM/SIGINT reach it.

    A scheduler signals the whole process group and ``areno train``'s supervisor forwards the same SIGTERM, so the
    launcher gets it twice; torch's own handler raises on each, and the second lands inside the agent's shutdown
    (its logging prints a traceback). Here the first raises torch's ``SignalException`` (the agent stops the ranks,
    which save and stop themselves) and later ones are ignored. torchrun's ``--signals-to-handle`` (``launch``
    passes it) keeps torch from installing its handler over this one for these two signals.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    got: list[int] = []

    def handler(signum, frame):
        if not got:
            got.append(signum)
            raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum)}",
                                  sigval=signal.Signals(signum))

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def launch(module: str, argv: list[str], nproc: int, *, stop_is_success: bool = False, describe=None,
           placement=None, max_restarts: int = 0) -> int:
    """Run ``python -m module argv`` on ``nproc`` local ranks with torch.distributed.run; returns the exit code.

    ``placement`` (cluster.Placement): this node among several (default: the only one); ``max_restarts``: how
    often the agent restarts the ranks after one dies (they resume from the last checkpoint themselves).

    A SIGTERM/SIGINT reaches the ranks through the launcher; with ``stop_is_success`` (a server) that is a normal
    stop (exit 0), otherwise the exit code says which signal ended the run. A rank that dies takes the others down
    with it (the launcher stops them); the message names it, with ``describe(rank)`` (its role and device).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    from areno.distributed.cluster import Placement, agent_args

    placement = placement or Placement("local")

    parser = get_args_parser()
    # SIGTERM/SIGINT are stop_once's (torch still handles SIGHUP/SIGQUIT); a torch without the option keeps its own
    own = ["--signals-to-handle", "SIGHUP,SIGQUIT"] if hasattr(parser.parse_args(["x"]), "signals_to_handle") else []
    args = parser.parse_args([
        *own, *agent_args(placement, nproc, max_restarts, placement.master_port or free_port()),
        "--module", module, *argv,
    ])
    # torchrun's own default for its ranks (one OpenMP thread each), set here so it does not print its banner
    # about it; a value the user set is kept.
    omp_default = "OMP_NUM_THREADS" not in os.environ and nproc > 1
    if omp_default:
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with stop_once():
            run(args)
    except SignalException as exc:
        return 0 if stop_is_success else 128 + int(exc.sigval)
    except RendezvousError as exc:  # a node that did not (re)join in time, or a rendezvous host out of reach
        print(f"areno: {placement.describe()}: the nodes did not all join the rendezvous ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else 'timed out'}); the run ends here", file=sys.stderr)
        return 1
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
    finally:
        if omp_default:
            os.environ.pop("OMP_NUM_THREADS", None)
    return 0
