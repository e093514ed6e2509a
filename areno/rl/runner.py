"""``areno train`` / ``python -m areno.train``: run the training loop on this process, or launch the ranks.

With ``--world-size N`` > 1 (or split mode: N train ranks plus one per ``--rollout-devices`` entry) outside a
torchrun worker, the resolved config travels to the ranks started by torch's elastic launcher
(``areno.distributed.worker``); inside a worker (or with one rank) the loop runs here (``train``), or, on a
split-mode rollout rank, the rollout engine (``serve_rollout_rank``). The SDK's ``Trainer`` runs the same loop.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict

from areno.distributed.cluster import place
from areno.distributed.launch import launched
from areno.distributed.parallel import env_rank
from areno.distributed.supervise import launch_recorded
from areno.distributed.watchdog import describe_rank, rank_timeout_s

CONFIG_ENV = "ARENO_TRAIN_CONFIG"


def is_rollout_rank(config) -> bool:
    """Whether this process is one of split mode's rollout ranks (they serve engines, not the loop)."""
    return bool(config.split) and env_rank() >= config.world_size


def serve_rollout_rank(config) -> int:
    """A rollout rank's whole run: engines until the train side closes them."""
    from areno.distributed.stop import StopRequest
    from areno.rl.rollout.remote import serve

    ignore = StopRequest(hard=False, quiet=True).install()  # a signal stops the train ranks, which then stop this one
    try:
        return serve(config)
    finally:
        ignore.uninstall()


def train(config) -> dict:
    """The whole run on this (train) rank: set-up, SFT warm-up, held-out accuracy before, the steps, accuracy after,
    the final save (``TrainLoop.fit``'s results)."""
    from areno.distributed.stop import StopRequest, is_rank_zero
    from areno.rl.loop import TrainLoop

    loop = TrainLoop(config)
    loop.stop_request = StopRequest(hard=not launched(), quiet=not is_rank_zero()).install()
    try:
        loop.setup()
        return loop.fit()  # ends with the last step's metrics, held-out accuracy before -> after, the checkpoint
    finally:
        loop.close()
        loop.stop_request.uninstall()


def run_train(config) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ranks = config.world_size + (len(config.rollout_devices) if config.split else 0)
    if not launched():  # a run without --save-path / --metrics-dir: its own runs/<time> folder, runs/latest -> it
        from areno.training.run_dir import link_latest

        link_latest(config)
    if not launched():
        placement = place(config, ranks)  # Slurm, a PyTorchJob, SkyPilot, --nnodes, or this node alone
        if placement.task_level:  # srun started one task per rank: this process is one
            os.environ.update(placement.task_env)
        elif ranks > 1 or placement.nnodes > 1 or config.max_restarts:
            rank_timeout_s()  # a bad ARENO_RANK_TIMEOUT_S: one line here, not one per rank
            os.environ[CONFIG_ENV] = json.dumps(asdict(config))
            return launch_recorded("areno.distributed.worker", ranks // placement.nnodes,
                                   lambda rank: describe_rank(config, rank), placement=placement,
                                   max_restarts=config.max_restarts)
    import torch.distributed as dist

    from areno.distributed import parallel
    from areno.distributed.stop import Stopped, is_rank_zero

    owned = not dist.is_initialized()  # a group this run makes is this run's to end (not a caller's)
    try:
        if is_rollout_rank(config):
            rc = serve_rollout_rank(config)  # a rollout rank: engines, not the loop
        else:
            train(config)
            rc = 0
    except Stopped as e:  # SIGTERM/SIGINT: saved at a step boundary, every rank at the same one
        if is_rank_zero():
            print(f"areno train: {e}", file=sys.stderr, flush=True)
        rc = e.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C: at once, without saving
        print("areno train: stopped at once by a second Ctrl-C (SIGINT): the steps since the last checkpoint are "
              "lost", file=sys.stderr, flush=True)
        return 130
    # An orderly end of a finished rank's process group (an error leaves it to the exit, where a pending NCCL
    # collective cannot hold it): left to the interpreter's exit, gloo's threads were sometimes destroyed unjoined
    # ("terminate called without an active exception", a SIGABRT after the run's last step).
    if owned:
        parallel.destroy_distributed()
    return rc
