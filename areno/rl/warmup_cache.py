"""The quickstart's post-warm-up state, cached: `areno train --preset quickstart` spends most of its time in the same
500 SFT steps whatever RL flags follow, so the state those steps leave (weights, optimizer moments and step count,
the warm-up's metrics lines) is saved under ``$ARENO_HOME/warmup/`` and loaded by the next run whose
warm-up would compute the very same bits.

The key is a hash of everything the warm-up reads: the starting checkpoint's files, the warm-up rows as tokenized,
every config field but those that act only after the warm-up or only on where things are written (``AFTER_WARMUP``),
areno's own source files, torch's version, the device, the CPU's vector capability and the thread count (float
rounding follows them). A run with any of these changed misses the cache and trains (and caches) its own warm-up.
A warm-up that drew random numbers is not cached (its result would also depend on the generators' state before it;
the quickstart's draws none). ``ARENO_WARMUP_CACHE=off`` turns the cache off. Entries are written atomically (a
temporary file renamed into place).

A single-rank run of the quickstart preset uses it, full-parameter or LoRA (see ``ADAPTER``); an MTP draft,
QLoRA and multi-rank training keep or change more state than this file holds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from areno.config.env import env_value

log = logging.getLogger("areno.train")

PRESETS = ("quickstart",)
# Config fields that cannot change the warm-up: they act on the RL steps after it (how long, how rollouts sample,
# how they are scored and evaluated), on where rollouts run (the warm-up is the trainer's alone), or on where and how
# results are written. The rows the warm-up trains on are in the key as tokenized, whatever flag shaped them.
# (--temperature stays in the key: the warm-up trains at temperature 1, but a CUDA-graphed trainer keeps the one it
# was built with.)
AFTER_WARMUP = frozenset({
    "max_steps", "eval_interval", "rollout_devices", "train_devices", "max_staleness", "top_p",
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "max_new_tokens",
    "min_new_tokens", "reward_timeout_s", "max_reward_failure_steps", "eval_dataset_path", "eval_n_samples",
    "eval_temperature", "eval_before_training", "eval_prompt_field", "eval_answer_field", "eval_prompt_format",
    "eval_system_prompt", "save_path", "metrics_dir", "overwrite", "save_interval", "save_interval_minutes",
    "tensorboard", "wandb_project", "wandb_run_name", "wandb_mode", "verbose", "rollout_dump_dir",
    "decode_progress_interval_s"})
# A LoRA run's warm-up trains the base itself with the adapter off (areno.training.lora.train_base): the same bits as
# the full-parameter run's warm-up (tests/rl/test_warmup_cache.py), so the adapter's settings are not in the key and
# a LoRA run loads the weights of a full run's entry (its own entries hold no optimizer state: the base's optimizer
# ends with its warm-up, so a full run that finds one trains its warm-up and writes a complete entry over it).
ADAPTER = frozenset({"lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_path", "merge_lora"})


def enabled(cfg, world: int) -> bool:
    """Whether this run's warm-up may be cached: the quickstart preset, one training rank, no MTP draft, no QLoRA
    (its base is quantised right after the warm-up)."""
    return (cfg.preset in PRESETS and (env_value("ARENO_WARMUP_CACHE") or "on") != "off" and world == 1
            and not cfg.mtp_loss_weight and cfg.quantize_base == "none")


def _source_digest() -> str:
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def key(cfg, rows, device: torch.device) -> str:
    """The hash naming the cache entry of this run's warm-up (``rows``: its tokenized Prompts, in order)."""
    from areno import __version__

    h = hashlib.sha256()
    ckpt = Path(cfg.ckpt).expanduser()
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(ckpt)).encode() + b"\0" + f.read_bytes())
    for p in rows:
        h.update(json.dumps([p.index, list(p.ids), list(p.responses["response"])]).encode())
    settings = {k: v for k, v in asdict(cfg).items() if k not in AFTER_WARMUP | ADAPTER and k != "ckpt"}
    capability = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else torch.cuda.get_device_name(
        device)
    h.update(json.dumps({"config": settings, "areno": __version__, "source": _source_digest(),
                         "torch": torch.__version__, "device": device.type, "machine": platform.machine(),
                         "capability": capability, "threads": torch.get_num_threads(),
                         "kernels": os.environ.get("ARENO_KERNELS")}, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def path_of(digest: str) -> Path:
    from areno.platform import areno_home

    return areno_home() / "warmup" / f"{digest}.pt"


def load(path: Path, model, trainer) -> list[tuple[int, dict]] | None:
    """Restore the cached state into ``model`` and ``trainer`` (None for a LoRA run: its base's weights only);
    returns the warm-up's metrics lines (step, metrics), or None when there is no readable entry for this run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError):  # none yet, or unreadable: train the warm-up
        return None
    if trainer is not None:
        if state["optimizer"] is None:  # a LoRA run's entry: no optimizer state for a full run to go on with
            return None
        trainer.optimizer.load_state_dict(state["optimizer"])
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(state["model"][name])
    return [(int(step), metrics) for step, metrics in state["records"]]


def rng_fingerprint() -> bytes:
    """The python, numpy, torch (and CUDA) generator states, as bytes to compare."""
    from areno.training.checkpoint import rng_state

    h = hashlib.sha256()
    for k, v in sorted(rng_state().items()):
        parts = v if isinstance(v, (list, tuple)) else [v]
        h.update(k.encode() + b"".join(t.numpy().tobytes() if isinstance(t, torch.Tensor) else repr(t).encode()
                                        for t in parts))
    return h.digest()


def save(path: Path, model, trainer, records: list[tuple[int, dict]], rng_before: bytes) -> bool:
    """Write the post-warm-up state of ``model`` and ``trainer`` (None for a LoRA run: the weights only, and only
    where no entry is) atomically (a crashed or concurrent run leaves no half-written entry); not if the warm-up
    drew random numbers (``rng_before``: ``rng_fingerprint()`` before it), as its result then depends on the
    generators' state before it too. Returns whether it was written."""
    if rng_fingerprint() != rng_before:
        log.info("SFT warm-up: not cached (it drew random numbers)")
        return False
    if trainer is None and path.exists():
        return False
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".warmup-", suffix=".pt", dir=path.parent)
        os.close(fd)
        torch.save({"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                    "optimizer": trainer.optimizer.state_dict() if trainer is not None else None,
                    "records": [[step, metrics] for step, metrics in records]}, tmp)
        os.replace(tmp, path)
    except OSError as e:  # a cache that cannot be written (read-only, full) costs the next run time, not this run
        log.warning("SFT warm-up: not cached in %s: %s", path.parent, e)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return True


class Entry:
    """One run's cache entry: ``load`` it into the run, or record the warm-up's lines (``recorder``) and ``save``
    the state the warm-up leaves."""

    def __init__(self, path: Path, adapter: bool):
        self.path, self.adapter = path, adapter  # adapter: a LoRA run (its warm-up's state: the base's weights)
        self.lines: list[tuple[int, dict]] = []
        self.last: dict = {}  # the warm-up's last metrics, once loaded
        self.rng = b""

    def load(self, model, trainer, logger, is_main: bool) -> bool:
        """Restore the entry into ``model`` and ``trainer`` and log its warm-up lines; False where there is none."""
        from areno.training import lora

        records = load(self.path, model, None if self.adapter else trainer)
        if records is None:
            self.rng = rng_fingerprint()
            return False
        if self.adapter:
            lora.end_train_base(model)  # as after a warm-up: the base is the run's own, saved with it
        for step, metrics in records if is_main else ():
            logger.log(step, metrics, stdout=False)
        if is_main:
            print(f"SFT warm-up: reused cached checkpoint {self.path} (the state its steps leave, saved by an earlier "
                  "run with the same inputs; ARENO_WARMUP_CACHE=off trains them again)", flush=True)
        self.last = {k.removeprefix("warmup_"): v for k, v in (records[-1][1] if records else {}).items()}
        return True

    def recorder(self, log):
        """``log`` (the metrics logger's), also keeping each line for the entry."""
        def record(step: int, metrics: dict, **kwargs):
            self.lines.append((step, metrics))
            log(step, metrics, **kwargs)
        return record

    def save(self, model, trainer) -> bool:
        return save(self.path, model, None if self.adapter else trainer, self.lines, self.rng)


def entry(cfg, rows, model, device: torch.device, world: int) -> Entry | None:
    """The cache entry of this run's warm-up (``rows``: its tokenized Prompts), or None where the run does not use
    the cache (``enabled``)."""
    from areno.models.lora import adapter_of

    if not enabled(cfg, world):
        return None
    return Entry(path_of(key(cfg, rows, device)), adapter_of(model) is not None)
