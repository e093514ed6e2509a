"""Save and resume a run: the checkpoint's training state (step, data position, schedule, held-out accuracy) and the
policy's weights read back into the live model."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from areno.config import ConfigError

log = logging.getLogger("areno.train")


def jsonable(d: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)) for k, v in d.items()}


def save(path, *, cfg, model, tokenizer, trainer, state: dict, rollout=None, group=None) -> Path:
    """Write a checkpoint of the policy, its optimizer and ``state`` (step, data, accuracy_before, ...) to ``path``;
    ``rollout``: its engine RNG and any rollout in flight (async split mode) go into this rank's state."""
    from areno.training import lora
    from areno.training.checkpoint import save_checkpoint
    from areno.training.mtp import draft_state

    path = Path(path)
    save_checkpoint(path, model=model, tokenizer=tokenizer, optimizer=trainer.optimizer,
                    extra_optimizers=draft_state(trainer),  # --mtp-loss-weight: the MTP draft's optimizer
                    save_model_fn=lora.save_fn(cfg),  # LoRA: the adapter in PEFT's files
                    trainer_state={"step": state["step"], "data": state["data"],
                                   "num_updates": trainer.num_updates, "config": jsonable(asdict(cfg)),
                                   "accuracy_before": state["accuracy_before"], "started_at": state["started_at"],
                                   "failed_reward_steps": state["failed_reward_steps"]},
                    rank_state={"engine_rng": rollout.rng_state(), "in_flight": rollout.in_flight_state()}
                    if rollout is not None else None, group=group)
    return path


def restart_count() -> int:
    """How often torch's elastic agent has restarted this run's ranks (``--max-restarts``); 0 on the first try."""
    import os

    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def after_restart(cfg):
    """The config a restarted rank runs: resume from the latest complete checkpoint under --save-path (exactly, as
    --resume does); none yet: the run's own first try left only its folder, so it starts over in it (or resumes
    --resume's checkpoint again). Unchanged on the first try."""
    from dataclasses import replace

    from areno.training.checkpoint import complete_checkpoints

    if not restart_count() or not cfg.save_path:
        return cfg
    if complete_checkpoints(cfg.save_path):
        return replace(cfg, resume="latest", overwrite=False)
    return cfg if cfg.resume else replace(cfg, overwrite=True)


def save_due(cfg, since: float, group) -> bool:
    """--save-interval-minutes: whether that long has passed since ``since`` (``time.monotonic()`` of the last save
    or the start), by rank 0's clock, so every rank of ``group`` saves at the same step."""
    import time

    if not cfg.save_interval_minutes:
        return False
    due = time.monotonic() - since >= 60 * cfg.save_interval_minutes
    if dist.is_initialized():
        from areno.distributed.collectives import broadcast_object

        due = broadcast_object(due, group)
    return due


def checkpoints_to_resume(cfg) -> list[Path]:
    """The folders --resume may load, best first: with ``latest``, every complete step-N of --save-path, newest
    first (an unreadable one gives way to the one before); else the one folder it names (checked; a bare name such
    as ``step-3`` is also looked up in --save-path)."""
    from areno.training.checkpoint import MARKER, complete_checkpoints, is_complete

    if cfg.resume in ("latest", "auto", ""):
        found = complete_checkpoints(cfg.save_path)
        if not found:
            raise ConfigError("--resume", f"found no complete checkpoint (a step-N folder with its {MARKER} "
                              f"marker) in {Path(cfg.save_path).expanduser().absolute()}; a run stopped before its "
                              "first checkpoint starts over when rerun without --resume")
        return found[::-1]
    path = Path(cfg.resume).expanduser()
    if not path.exists() and cfg.save_path and (Path(cfg.save_path).expanduser() / cfg.resume).exists():
        path = Path(cfg.save_path).expanduser() / cfg.resume
    if not is_complete(path):
        why = "does not exist" if not path.exists() else f"is not a complete areno checkpoint (no {MARKER})"
        raise ConfigError("--resume", f"{path.absolute()} {why}")
    return [path]


def _load(path: Path, *, model, trainer, device, dtype, tp_group) -> dict:
    """Read one checkpoint into ``model`` and ``trainer``; raises on anything unreadable and on weights that are
    not finite (checked before anything is changed)."""
    from areno.models import load_model
    from areno.models.lora import adapter_of
    from areno.training import lora
    from areno.training.checkpoint import load_checkpoint
    from areno.training.mtp import draft_state

    if adapter_of(model) is not None:  # a LoRA checkpoint: the adapter (the base is --ckpt's, unchanged)
        lora.load(path, model)
        return load_checkpoint(path, optimizer=trainer.optimizer, rank=dist.get_rank() if dist.is_initialized() else 0)
    fresh = load_model(path, dtype=dtype, device=device, tp_group=tp_group)
    bad = [name for name, q in fresh.named_parameters() if not torch.isfinite(q).all()]
    if bad:
        raise ValueError(f"its weights hold NaN or inf ({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")
    state = load_checkpoint(path, optimizer=trainer.optimizer, rank=dist.get_rank() if dist.is_initialized() else 0,
                            extra_optimizers=draft_state(trainer))
    with torch.no_grad():
        for p, q in zip(model.parameters(), fresh.parameters()):
            p.copy_(q)
    if getattr(trainer, "mtp", None) is not None:  # the draft from the checkpoint's MTP tensors
        trainer.mtp.reload()
    return state


def restore(cfg, *, model, trainer, device, dtype, tp_group, train_group) -> tuple[Path, dict]:
    """Load --resume's checkpoint into ``model`` and ``trainer`` (optimizer state, update count); returns the
    folder and its training state. A checkpoint that cannot be read (cut, garbage) or whose weights are not finite
    is refused with a warning and the previous complete one is loaded instead; none left is a ``ConfigError``.
    Checkpoints (and metrics rows) past the loaded step are moved aside (``run_dir.retire_after``)."""
    from areno.distributed.collectives import gather_objects
    from areno.training.run_dir import retire_after

    if dist.is_initialized():
        dist.barrier(group=train_group)  # rank 0 has recovered the save folder (run_dir.claim) first
    refused = []
    for path in checkpoints_to_resume(cfg):
        try:
            state, why = _load(path, model=model, trainer=trainer, device=device, dtype=dtype, tp_group=tp_group), None
        except Exception as e:  # noqa: BLE001 - any unreadable file: cut, garbage, wrong pickle, NaN
            state, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        whys = [w for w in gather_objects(why, train_group) if w]  # every rank loads the same step
        if not whys:
            break
        refused.append(f"{path} ({whys[0]})")
        log.warning("cannot resume from %s: %s", path, whys[0])
    else:
        raise ConfigError("--resume", f"found no intact checkpoint to resume from: {'; '.join(refused)}")
    if refused:
        log.warning("resuming from %s, the latest intact checkpoint", path)
    trainer.num_updates = state.get("num_updates", 0)
    if cfg.save_path and (dist.get_rank() if dist.is_initialized() else 0) == 0:  # rank 0 owns the save folder
        retire_after(cfg.save_path, state["step"], Path(cfg.metrics_folder) / "metrics.jsonl")
    return path, state
