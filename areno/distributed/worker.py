"""One rank of a multi-process ``areno train`` run, started by torch's elastic launcher (see launch.py)."""

import json
import os
import sys

from areno.config import ConfigError, RunError, TrainConfig
from areno.config.env import env_value
from areno.distributed.supervise import die_with_parent, record_exit
from areno.rl.resume import after_restart
from areno.rl.runner import CONFIG_ENV, run_train


def main() -> int:
    die_with_parent()  # a rank must not outlive the launcher (SIGKILL leaves it no chance to stop its workers)
    record_exit(f"rank-{os.environ.get('RANK', '0')}")  # the launcher tells a finished rank from one that vanished
    raw = env_value(CONFIG_ENV)
    if not raw:
        print(f"areno.distributed.worker: {CONFIG_ENV} is not set; start runs with `areno train`", file=sys.stderr)
        return 2
    try:
        return run_train(after_restart(TrainConfig(**json.loads(raw))))
    except (ConfigError, RunError) as e:  # one line, as `areno train` prints it, from the rank that saw it
        print(f"areno train: error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
