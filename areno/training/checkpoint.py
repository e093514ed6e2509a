"""Training checkpoints: the Hugging Face model folder plus the state needed to resume, written atomically.

Layout of ``save_path/step-{N}`` (reloadable as a model with ``--ckpt`` or ``--model-path``)::

    config.json, *.safetensors, tokenizer files     the policy, written by ``areno.models.save_model``
    training_state/optimizer-rank{r}.pt             each rank's optimizer shard (MasterAdamW.state_dict())
    training_state/optimizer-{name}-rank{r}.pt      each further optimizer's (``extra_optimizers``: the MTP draft's)
    training_state/rng-rank{r}.pt                   each rank's python / numpy / torch / CUDA RNG states
    training_state/trainer.json                     step, data position, config, scheduler, world size
    COMPLETE                                        written last: a folder without it is never loaded

Everything is written into ``.{name}.tmp-{pid}-{rand}`` beside the target, and the finished folder is renamed into
place (an existing one is first renamed to ``.{name}.old-{pid}-{rand}``, then removed). A kill at any moment leaves
the previous checkpoint or the new one, and a hidden folder; ``latest_checkpoint`` only answers complete
``step-{N}`` folders. ``recover`` (run before a resume) renames the complete ``.old`` copy left by a kill between the
two renames back to ``step-{N}``; other hidden folders left by dead processes are removed by the next save. Before
writing, the free space is checked against the checkpoint's size (the previous checkpoint's, or an estimate), and a
disk that fills up during the write is reported as ``DiskFullError`` naming the folder and the bytes needed: the
previous checkpoint is untouched either way. Only files this module wrote are unpickled (``weights_only=True``).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from areno.config import RunError
from areno.distributed.collectives import broadcast_object
from areno.models.saver import swap_in

STATE_DIR = "training_state"
MARKER = "COMPLETE"
_STEP = re.compile(r"step-(\d+)")
_OLD = re.compile(r"\.step-(\d+)\.old-\d+-[0-9a-f]+")
_TMP = re.compile(r"\.(.+)\.(?:tmp|old)-(\d+)-[0-9a-f]+")  # also matches save_model's own ``.tmp-`` inside a tmp


def _dist(group=None) -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _barrier(world: int, group=None) -> None:
    if world > 1:
        dist.barrier(group=group)


# ---- RNG -------------------------------------------------------------------------------------------------------
def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) generator states, as plain types and tensors."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- save ------------------------------------------------------------------------------------------------------
class DiskFullError(RunError, OSError):
    """The disk cannot hold the checkpoint; the message names the folder and the bytes needed."""


def _gib(n: float) -> str:
    if n < 2**20:
        return f"{n} bytes"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def estimate_bytes(path: Path, model=None, optimizer=None, world: int = 1) -> int:
    """What a checkpoint at ``path`` will take: the size of the newest complete sibling ``step-N`` if there is one,
    else the model's tensors plus ``world`` ranks' optimizer state."""
    previous = latest_checkpoint(path.parent)
    if previous is not None:
        return folder_bytes(previous)
    total = 0
    if model is not None:
        seen = set()
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size() * (model.tp_group.size() if getattr(model, "tp_group", None)
                                                         is not None else 1)
    if hasattr(optimizer, "state_bytes"):  # MasterAdamW: fp32 masters and moments, or 8-bit moments
        total += optimizer.state_bytes() * world
    return total


def _check_space(path: Path, needed: int) -> None:
    free = shutil.disk_usage(path.parent).free
    if free < needed:
        raise DiskFullError(errno.ENOSPC, f"not enough disk space to save checkpoint {path}: it needs about "
                            f"{_gib(needed)} ({needed} bytes) and {path.parent} has {_gib(free)} free; the previous "
                            "checkpoint is intact")


def _disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)  # torch.save and safetensors report a short write without the errno
    return isinstance(e, (RuntimeError, OSError)) and any(
        k in text for k in ("unexpected pos", "No space left", "file write failed", "Disk quota"))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: Path) -> None:
    """Hidden tmp/old folders of saves whose process is gone (never an ``.old`` that is the only complete copy)."""
    for d in parent.iterdir():
        m = _TMP.match(d.name)
        if m is None or not d.is_dir() or int(m.group(2)) == os.getpid() or _alive(int(m.group(2))):
            continue
        old = _OLD.fullmatch(d.name)
        if old and not (parent / f"step-{old.group(1)}" / MARKER).is_file() and (d / MARKER).is_file():
            continue
        shutil.rmtree(d, ignore_errors=True)


def save_checkpoint(path, *, model, tokenizer=None, optimizer=None, scheduler_state=None, trainer_state: dict,
                    rng: bool = True, save_model_fn=None, rank_state=None, group=None,
                    extra_optimizers: dict | None = None) -> Path:
    """Write a checkpoint at ``path`` (every rank calls this: a collective). ``save_model_fn(model, dir, tokenizer)``
    runs on every rank (areno's ``save_model`` gathers TP shards and writes on global rank 0); each rank writes its
    optimizer and RNG files (with ``rank_state``, this rank's extra state such as its rollout engine's generator);
    rank 0 writes ``trainer.json`` (``trainer_state`` must be JSON-able; ``Path`` and other objects are written as
    strings) and the marker, then renames the folder into place. Returns ``path``; raises ``DiskFullError`` when the
    disk cannot hold it (checked before writing, and caught during the write). ``group``: the ranks that save (split
    mode's train ranks; default all, whose rank 0 must be the global rank 0). ``extra_optimizers``: {name: optimizer}
    of further trained parameters (the MTP draft's), each rank's state in its own file."""
    if save_model_fn is None:
        from areno.models import save_model as save_model_fn
    path = Path(path).expanduser().absolute()
    rank, world = _dist(group)
    tmp, problem, needed = None, None, 0
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path.parent)
        needed = estimate_bytes(path, model, optimizer, world)
        try:
            _check_space(path, needed)
            tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
        except DiskFullError as e:
            problem = e
    if world > 1:
        where, why = broadcast_object((str(tmp) if tmp is not None else None, str(problem) if problem else None),
                                      group)
        tmp = Path(where) if where else None
        if why and problem is None:
            problem = DiskFullError(errno.ENOSPC, why)
    if problem is not None:
        raise problem
    try:
        save_model_fn(model, tmp, tokenizer)  # areno's save_model replaces the (empty) tmp folder with its own
        state = tmp / STATE_DIR
        if rank == 0:
            state.mkdir(exist_ok=True)
        _barrier(world, group)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), state / f"optimizer-rank{rank}.pt")
        for name, extra in (extra_optimizers or {}).items():
            torch.save(extra.state_dict(), state / f"optimizer-{name}-rank{rank}.pt")
        if rng or rank_state is not None:
            torch.save({**(rng_state() if rng else {}), "rank_state": rank_state}, state / f"rng-rank{rank}.pt")
        _barrier(world, group)
        if rank == 0:
            meta = {"format": 1, "world_size": world, "saved_at": time.time(), "optimizer": optimizer is not None,
                    "rng": bool(rng), "scheduler": scheduler_state, "trainer": trainer_state}
            (state / "trainer.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
            for f in tmp.rglob("*"):  # durable before the marker says so (a power cut, not only a kill)
                if f.is_file():
                    _fsync(f)
            (tmp / MARKER).write_text(json.dumps({"world_size": world}) + "\n")
            _fsync(tmp / MARKER)
            _fsync(tmp)
            swap_in(tmp, path)
            _fsync(path.parent)
    except BaseException as e:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(e) and not isinstance(e, DiskFullError):
            free = shutil.disk_usage(path.parent).free
            raise DiskFullError(errno.ENOSPC, f"the disk filled up while saving checkpoint {path}: it needs about "
                                f"{_gib(needed)} ({needed} bytes) and {path.parent} has {_gib(free)} free; the "
                                "previous checkpoint is intact") from e
        raise
    _barrier(world, group)
    return path


# ---- load ------------------------------------------------------------------------------------------------------
def is_complete(path) -> bool:
    return (Path(path) / MARKER).is_file()


def load_checkpoint(path, *, optimizer=None, rank: int | None = None, rng: bool = True,
                    extra_optimizers: dict | None = None) -> dict:
    """Read a checkpoint's training state: restores ``optimizer`` (this rank's shard; ``extra_optimizers``, {name:
    optimizer}, theirs) and the RNG states, and returns the saved ``trainer_state`` dict (plus ``"scheduler_state"``
    when one was saved, and ``"rank_state"``, this rank's extra state, when one was saved). ``rank`` defaults to the
    global rank."""
    path = Path(path).expanduser()
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete areno checkpoint (no {MARKER} marker): the save was "
                                "interrupted or the folder was not written by save_checkpoint")
    if rank is None:
        rank = _dist()[0]
    state = path / STATE_DIR
    meta = json.loads((state / "trainer.json").read_text())
    if optimizer is not None:
        f = state / f"optimizer-rank{rank}.pt"
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: {path} was saved by {meta['world_size']} ranks "
                                    f"{'with' if meta['optimizer'] else 'without'} optimizer state")
        optimizer.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))
    for name, extra in (extra_optimizers or {}).items():
        f = state / f"optimizer-{name}-rank{rank}.pt"
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: {path} was saved without the {name} optimizer's state")
        extra.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))
    out = dict(meta["trainer"])
    f = state / f"rng-rank{rank}.pt"
    if f.is_file():
        saved = torch.load(f, map_location="cpu", weights_only=True)
        if saved.get("rank_state") is not None:
            out["rank_state"] = saved["rank_state"]
        saved.pop("rank_state", None)
        if rng and meta["rng"]:
            set_rng_state(saved)
    elif rng and meta["rng"]:
        raise FileNotFoundError(f"{f} is missing: {path} was saved by {meta['world_size']} ranks")
    if meta["scheduler"] is not None:
        out["scheduler_state"] = meta["scheduler"]
    return out


def complete_checkpoints(save_path) -> list[Path]:
    """The complete ``save_path/step-{N}`` folders, by N (oldest first)."""
    root = Path(save_path).expanduser()
    if not root.is_dir():
        return []
    found = {int(m.group(1)): d for d in root.iterdir() if (m := _STEP.fullmatch(d.name)) and is_complete(d)}
    return [found[n] for n in sorted(found)]


def latest_checkpoint(save_path) -> Path | None:
    """The complete ``save_path/step-{N}`` with the highest N (None if there is none)."""
    found = complete_checkpoints(save_path)
    return found[-1] if found else None


def recover(save_path) -> list[Path]:
    """Put back the complete ``.step-N.old-*`` copies that a save killed between its two renames left as the only
    complete ``step-N`` (their process gone), under their own name; returns the folders restored."""
    root = Path(save_path).expanduser()
    restored = []
    if not root.is_dir():
        return restored
    for d in sorted(root.iterdir()):
        m = _OLD.fullmatch(d.name)
        if m is None or not is_complete(d) or _alive(int(d.name.rsplit("-", 2)[-2])):
            continue
        target = root / f"step-{m.group(1)}"
        if is_complete(target):
            continue
        if target.is_symlink():  # a link under the final name: removed, never followed
            target.unlink()
        elif target.exists():  # an incomplete folder under the final name (not written by this module): set aside
            shutil.rmtree(target)
        os.rename(d, target)
        restored.append(target)
    return restored
