"""The ``quickstart`` preset: a tiny model areno creates itself, an SFT warm-up on a sloppy teacher's
demonstrations, then GRPO against an exact verifier, on two-digit addition. No download, no GPU.

The story (see ``task.py``): the teacher forgets to carry in 60% of its demonstrations (``47+85=122``), so after the
SFT warm-up the model answers most carry problems wrong when decoding greedily, although sampling still finds the
true sum often. GRPO with a reward of 1 for exactly the true sum moves the model onto it: held-out accuracy (200
problems never trained on, greedy) goes from about two thirds to nearly all. RL on a verifiable reward improves on
imperfect demonstrations.

The model is created once (random weights from a fixed seed, the byte-level tokenizer of ``areno.testing``) and
cached under ``$ARENO_HOME/quickstart/`` (default ``~/.cache/areno/quickstart/``). On two CPU cores the whole run
takes about two minutes: 500 SFT steps (~65 s), 40 GRPO steps (~40 s); the state the SFT steps leave is cached
(``areno/rl/warmup_cache.py``), so a later run with the same warm-up inputs starts at RL, bit for bit. Every flag
given on the command line still overrides the preset's value, e.g. ``--max-steps 10``, ``--seed 1`` or
``--dataset-path teacher_error=0`` (a perfect teacher, leaving RL little to fix).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from areno.config import TrainConfig
from areno.presets import register_preset

TASK = Path(__file__).resolve().with_name("task.py")
# The model the quickstart trains: qwen3 layout, two layers of width 128 (about 0.4M parameters with the tied
# embedding of the tiny tokenizer). Bump MODEL_VERSION with any change here: it names the cache folder, so an old
# cached model is never reused.
MODEL = dict(family="qwen3", seed=0, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.05)
MODEL_VERSION = "addition-v2"


def cache_dir() -> Path:
    from areno.platform import areno_home

    return areno_home() / "quickstart"


def model_path() -> Path:
    """The quickstart model's folder, created on first use."""
    return cached_model(cache_dir() / f"model-{MODEL_VERSION}", MODEL)


def cached_model(path: Path, model: dict) -> Path:
    """A tiny ``model`` (``make_tiny_checkpoint`` arguments) at ``path``, created on first use (atomically: a crashed
    or concurrent run leaves no half-written model behind)."""
    if (path / "model.safetensors").exists():
        return path
    from areno.testing import make_tiny_checkpoint

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=path.parent))
    try:
        kwargs = dict(model)
        make_tiny_checkpoint(tmp, kwargs.pop("family"), kwargs.pop("seed"), **kwargs)
        try:
            os.rename(tmp, path)
        except OSError:  # another process created it first
            if not (path / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def cpu_threads():
    """The quickstart's matrices are tiny: on a CPU, extra intra-op threads only add synchronisation (and on a busy
    machine spin-waiting), so use one unless the user chose with OMP_NUM_THREADS."""
    import torch

    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


@register_preset("quickstart")
def quickstart() -> TrainConfig:
    cpu_threads()
    return TrainConfig(
        preset="quickstart",
        ckpt=str(model_path()),
        dataset_loader_fn=str(TASK),
        reward_fn_path=str(TASK),
        algo="grpo",
        batch_size=64,
        n_samples=4,
        mini_bs=256,
        lr=5e-4,
        sft_warmup_steps=500,
        sft_warmup_lr=2e-3,
        max_steps=40,
        temperature=1.0,
        max_new_tokens=6,
        max_prompt_tokens=64,
        activation_checkpointing=False,
        eval_interval=10,
        save_path="runs/quickstart",
        overwrite=True,  # a demo: running it again replaces the last one (an explicit --resume continues it instead)
        # no metrics_dir: it follows the save path (<save_path>/metrics), so --save-path X keeps the metrics in X
        tensorboard=False,
        dtype="float32",  # the numbers measured on CPU hold on a GPU too (bf16 would change them); tiny either way
    )
