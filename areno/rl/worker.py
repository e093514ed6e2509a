"""One rank of a multi-process ``areno train`` run, started by torch's elastic launcher (see launch.py)."""

import json
import os
import sys

from areno.config import TrainConfig
from areno.rl.runner import CONFIG_ENV, run_train


def main() -> int:
    raw = os.environ.get(CONFIG_ENV)
    if not raw:
        print(f"areno.rl.worker: {CONFIG_ENV} is not set; start runs with `areno train`", file=sys.stderr)
        return 2
    return run_train(TrainConfig(**json.loads(raw)))


if __name__ == "__main__":
    sys.exit(main())
