"""Save and resume a run: the checkpoint's training state (step, data position, schedule, held-out accuracy) and the
policy's weights read back into the live model."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from areno.config import ConfigError


def jsonable(d: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)) for k, v in d.items()}


def save(path, *, cfg, model, tokenizer, trainer, state: dict, rollout=None, group=None) -> Path:
    """Write a checkpoint of the policy, its optimizer and ``state`` (step, data, accuracy_before, ...) to ``path``;
    ``rollout``: its engine RNG and any rollout in flight (async split mode) go into this rank's state."""
    from areno.training.checkpoint import save_checkpoint

    path = Path(path)
    save_checkpoint(path, model=model, tokenizer=tokenizer, optimizer=trainer.optimizer,
                    trainer_state={"step": state["step"], "data": state["data"],
                                   "num_updates": trainer.num_updates, "config": jsonable(asdict(cfg)),
                                   "accuracy_before": state["accuracy_before"], "started_at": state["started_at"],
                                   "failed_reward_steps": state["failed_reward_steps"]},
                    rank_state={"engine_rng": rollout.rng_state(), "in_flight": rollout.in_flight_state()}
                    if rollout is not None else None, group=group)
    return path


def checkpoint_to_resume(cfg) -> Path:
    """The folder --resume names: the latest complete step-N of --save-path, or the given folder (checked)."""
    from areno.training.checkpoint import MARKER, is_complete, latest_checkpoint

    if cfg.resume in ("latest", "auto", ""):
        path = latest_checkpoint(cfg.save_path)
        if path is None:
            raise ConfigError("--resume", f"found no complete checkpoint (a step-N folder with its {MARKER} "
                              f"marker) in {Path(cfg.save_path).expanduser().absolute()}")
        return path
    path = Path(cfg.resume).expanduser()
    if not is_complete(path):
        why = "does not exist" if not path.exists() else f"is not a complete areno checkpoint (no {MARKER})"
        raise ConfigError("--resume", f"{path.absolute()} {why}")
    return path


def restore(cfg, *, model, trainer, device, dtype, tp_group, train_group) -> tuple[Path, dict]:
    """Load --resume's checkpoint into ``model`` and ``trainer`` (optimizer state, update count); returns the
    folder and its training state."""
    from areno.models import load_model
    from areno.training.checkpoint import load_checkpoint

    if dist.is_initialized():
        dist.barrier(group=train_group)  # rank 0 has recovered the save folder (run_dir.claim) first
    path = checkpoint_to_resume(cfg)
    state = load_checkpoint(path, optimizer=trainer.optimizer, rank=dist.get_rank() if dist.is_initialized() else 0)
    fresh = load_model(path, dtype=dtype, device=device, tp_group=tp_group)
    with torch.no_grad():
        for p, q in zip(model.parameters(), fresh.parameters()):
            p.copy_(q)
    del fresh
    trainer.num_updates = state.get("num_updates", 0)
    return path, state
