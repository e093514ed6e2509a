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
    from areno.rl.loop import TrainLoop

    loop = TrainLoop(config)
    try:
        loop.setup()
        loop.warmup()
        before = loop.evaluate() if loop.eval_data else None
        if loop.is_main and before is not None:
            print(f"held-out accuracy before {config.algo}: {before:.3f}", flush=True)
        last = loop.run()
        after = loop.evaluate() if loop.eval_data else None
        if loop.is_main and before is not None:
            print(f"held-out accuracy: {before:.3f} before {config.algo}, {after:.3f} after", flush=True)
        loop.results = {"accuracy_before": before, "accuracy_after": after}
        if loop.is_main and last:
            print("final step: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(last.items())
                                             if isinstance(v, (int, float))))
    finally:
        if hasattr(loop, "logger"):
            loop.close()
    return 0
