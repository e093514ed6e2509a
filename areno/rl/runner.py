"""``areno train`` / ``python -m areno.train``: run the training loop on this process, or launch the ranks.

With ``--world-size N`` > 1 outside a torchrun worker, the resolved config travels to N ranks started by torch's
elastic launcher (``areno.rl.worker``); inside a worker (or with one rank) the loop runs here.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict

from areno.rl.launch import launch, launched

CONFIG_ENV = "ARENO_TRAIN_CONFIG"


def run_train(config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.world_size > 1 and not launched():
        os.environ[CONFIG_ENV] = json.dumps(asdict(config))
        return launch("areno.rl.worker", [], config.world_size)
    from areno.api import Trainer

    trainer = Trainer.from_config(config)  # the CLI runs on the SDK
    try:
        trainer.init()
        trainer.fit()  # ends with the last step's metrics, held-out accuracy before -> after, the checkpoint
    finally:
        trainer.close()
    return 0
