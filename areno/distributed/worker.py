"""One rank of a multi-process ``areno train`` run, started by torch's elastic launcher (see launch.py)."""

import ctypes
import json
import os
import signal
import sys

from areno.config import TrainConfig
from areno.config.env import env_value
from areno.rl.runner import CONFIG_ENV, run_train


def _die_with_launcher() -> None:
    """A rank must not outlive the launcher that started it: if ``areno train`` is killed outright (SIGKILL leaves
    torch's launcher no chance to stop its workers), the kernel ends this process too (Linux PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the call above
        os._exit(1)


def main() -> int:
    _die_with_launcher()
    raw = env_value(CONFIG_ENV)
    if not raw:
        print(f"areno.distributed.worker: {CONFIG_ENV} is not set; start runs with `areno train`", file=sys.stderr)
        return 2
    return run_train(TrainConfig(**json.loads(raw)))


if __name__ == "__main__":
    sys.exit(main())
