"""A LoRA run's glue (``--lora-rank`` > 0): the adapter on the loaded policy, what the optimizer sees, the reference
as the base with the adapter off, and the checkpoint's files.

The rollout engine of a colocated run decodes with the policy module itself, so it applies the adapter unmerged
(the same hooks as training: rollout and trainer log-probs come from one path). A LoRA checkpoint holds the adapter in
PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``, base: ``--ckpt``), the tokenizer and the
training state; ``--merge-lora`` adds the merged full weights in ``<checkpoint>/merged``. Resume reads the adapter
back into the live one. An --sft-warmup-steps warm-up trains the base itself, the adapter off (it stands in for the
base's own training: LoRA adapts a trained base; the quickstart's is random); from then on checkpoints also hold that
base in ``<checkpoint>/base`` (the adapter's base) and resume reads it back. Under TP the adapter is sharded with its
layers (models/lora.py): every rank takes part in a save (the shards are gathered), rank 0 writes whole files.

QLoRA (--quantize-base nf4, ``models/qlora.py``): the base's projections are quantised as --ckpt loads
(``load_base``: one projection in --dtype on the device at a time), or, when an --sft-warmup-steps warm-up trains the
base (it loads in --dtype then), at the end of the warm-up (which stands in for the base's own training); a
checkpoint's ``base/`` then holds the dequantised base (what the adapter saw) and ``base_nf4.safetensors`` its NF4
bytes, which resume reads back; without a warm-up, resume quantises --ckpt again (deterministic: the same bytes).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from areno.config import ConfigError
from areno.models import lora_experts, qlora
from areno.models.lora import ALL_LINEAR, LoraError, LoraSpec, adapter_of, attach, read_peft_config

MERGED_DIR, BASE_DIR = "merged", "base"
NF4_BASE_FILE = "base_nf4.safetensors"  # a QLoRA checkpoint's warm-up-trained base, quantised (resume reads it)


def spec_of(cfg) -> LoraSpec:
    """The adapter the flags describe; with --lora-path, the adapter file's own (flags that contradict it refused)."""
    names = [t.strip() for t in cfg.lora_target_modules.split(",") if t.strip()]
    targets = ALL_LINEAR if names == [ALL_LINEAR] else tuple(names)
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank
    if not cfg.lora_path:
        return LoraSpec(cfg.lora_rank, float(alpha), cfg.lora_dropout, targets)
    spec = read_peft_config(cfg.lora_path)
    if spec.rank != cfg.lora_rank:
        raise ConfigError("--lora-rank", f"{cfg.lora_rank} differs from the rank of --lora-path's adapter "
                                         f"(r={spec.rank}); give --lora-rank {spec.rank}")
    if cfg.lora_alpha is not None and float(cfg.lora_alpha) != spec.alpha:
        raise ConfigError("--lora-alpha", f"{cfg.lora_alpha} differs from --lora-path's lora_alpha {spec.alpha}")
    if targets != ALL_LINEAR and set(targets) != set(spec.target_modules if spec.target_modules != ALL_LINEAR
                                                     else ()):
        raise ConfigError("--lora-target-modules", f"{cfg.lora_target_modules} differs from --lora-path's "
                                                   f"target_modules {spec.target_modules}")
    return LoraSpec(spec.rank, spec.alpha, cfg.lora_dropout, spec.target_modules)


def load_base(cfg, **kwargs):
    """``load_model(cfg.ckpt, **kwargs)``; with --lora-rank and --quantize-base nf4 the base quantised as it loads
    (``models/loader.py``), unless an --sft-warmup-steps warm-up trains it first (``apply`` leaves it to the warm-up's
    end). What QLoRA does not build (MoE, MLA, TP) is refused naming --quantize-base, before any weight is read."""
    from areno.models import load_model

    nf4 = cfg.lora_rank and cfg.quantize_base == "nf4" and not cfg.sft_warmup_steps
    with flag_errors():
        return load_model(cfg.ckpt, quantize_base="nf4" if nf4 else None, **kwargs)


@contextlib.contextmanager
def flag_errors():
    """A ``LoraError`` raised in the block becomes the ``ConfigError`` of the flag it names (exit 2 naming it)."""
    try:
        yield
    except LoraError as e:
        raise ConfigError(e.field, str(e).split(": ", 1)[1]) from e


def apply(cfg, model):
    """With --lora-rank > 0: freeze ``model``, hook in the adapter (from --lora-path if given) and with
    --quantize-base nf4 quantise what ``load_base`` left unquantised (after the warm-up when --sft-warmup-steps trains
    the base); returns the adapter or None."""
    if not cfg.lora_rank:
        return None
    with flag_errors():
        adapter = attach(model, spec_of(cfg))
        if adapter.expert_sites and getattr(cfg, "rollout_devices", None) is not None:
            raise LoraError("--lora-target-modules", f"{adapter.expert_sites[0].target}: LoRA on MoE experts in split "
                                                     "mode (--rollout-devices) is not built yet (the expert adapters' "
                                                     "sync is untested); train colocated")
        if cfg.lora_path:
            adapter.load_weights(Path(cfg.lora_path).expanduser())
        if cfg.quantize_base == "nf4":
            qlora.quantizable(model)  # refused here if not built, before any step
            adapter.quantize_pending = True
            if not cfg.sft_warmup_steps:
                quantize_pending(model)
    return adapter


def quantize_pending(model) -> None:
    """Quantise the base if --quantize-base nf4 waits for it (after the warm-up, or when none runs)."""
    adapter = adapter_of(model)
    if adapter is not None and adapter.quantize_pending:
        qlora.quantize_base(model)
        adapter.quantize_pending = False


def optimizer_params(model) -> list | None:
    """The adapter's parameters (the only trainable ones), or None for a run without LoRA (or while its base
    trains: ``train_base``)."""
    adapter = adapter_of(model)
    return None if adapter is None or not adapter.enabled else list(adapter.parameters())


def train_base(model) -> bool:
    """A LoRA run's --sft-warmup-steps: the base itself trains (the warm-up stands in for the base's own training,
    as a real base has had), the adapter off. True if ``model`` has an adapter (then ``end_train_base`` after)."""
    adapter = adapter_of(model)
    if adapter is None:
        return False
    adapter.enabled = False
    for p in adapter.base_trainable:
        p.requires_grad_(True)
    return True


def end_train_base(model) -> None:
    """After the warm-up: the base frozen again (and saved with each checkpoint: it is no longer --ckpt's), the
    adapter on."""
    adapter = adapter_of(model)
    for p in model.parameters():
        p.grad = None
        p.requires_grad_(False)
    adapter.enabled, adapter.base_changed = True, True
    quantize_pending(model)  # QLoRA quantises the base the warm-up trained


class BaseModel:
    """The policy with its adapter switched off: the reference model of a LoRA run, no second copy of the weights.
    Forwards every attribute to the policy; calling it runs the policy under ``adapter.disabled()``."""

    def __init__(self, policy):
        self.__dict__["policy"] = policy

    def __getattr__(self, name):
        return getattr(self.__dict__["policy"], name)

    def __call__(self, *args, **kwargs):
        policy = self.__dict__["policy"]
        with adapter_of(policy).disabled():
            return policy(*args, **kwargs)


def reference(cfg, policy):
    """The reference of a LoRA run without --ref-ckpt (the base), else None (load --ref-ckpt as usual)."""
    if adapter_of(policy) is None or cfg.ref_ckpt:
        return None
    return BaseModel(policy)


def save_fn(cfg):
    """``save_checkpoint``'s writer of a LoRA run (None without LoRA): the PEFT adapter and the tokenizer (rank 0),
    with --merge-lora the merged full weights in ``merged/``."""

    def write(model, folder, tokenizer=None):
        import torch.distributed as dist
        from safetensors.torch import save_file

        from areno.models import save_model

        writer = not dist.is_initialized() or dist.get_rank() == 0
        folder = Path(folder)
        adapter = adapter_of(model)
        # every rank: under TP the adapter's shards and the base's are gathered (a collective); rank 0 writes
        adapter.save(folder, base=BASE_DIR if adapter.base_changed else cfg.ckpt, write=writer)
        if adapter.base_changed:  # trained by the warm-up: the adapter's base is the checkpoint's own
            with adapter.disabled(), qlora.dequantized(model):  # QLoRA: the base as the adapter saw it
                save_model(model, folder / BASE_DIR, tokenizer)
            if writer and qlora.is_quantized(model):  # and its NF4 bytes, so resume gets them back exactly
                save_file(qlora.nf4_state(model), str(folder / NF4_BASE_FILE), metadata={"format": "pt"})
        if tokenizer is not None and writer:
            tokenizer.save_pretrained(str(folder))
        if cfg.merge_lora:
            save_merged(model, folder / MERGED_DIR, tokenizer)

    return write if cfg.lora_rank else None


def save_merged(model, folder, tokenizer=None) -> Path:
    """Write ``model`` with its adapter merged (``W + B A * alpha / r``; MoE experts' per expert) as a full
    checkpoint loadable by transformers and areno (a QLoRA base: ``W`` dequantised); the live weights are restored
    after. Under TP each rank merges its own shard (every rank calls it)."""
    from areno.models import save_model

    adapter = adapter_of(model)
    modules = dict(model.named_modules())
    kept = {}
    with torch.no_grad(), qlora.dequantized(model):  # QLoRA: merged into the dequantised base
        for s in adapter.sites:
            w = modules[s.module].weight
            kept.setdefault(s.module, w.detach().clone())
            offset, count = s.span(adapter.tp_rank, adapter.tp_size)
            rows = w[offset : offset + count]
            rows.copy_((rows.float() + adapter.pair(s.hf_module).delta_weight().float()).to(w.dtype))
        kept_experts = lora_experts.merge(model, adapter.expert_pair_list())
        try:
            with adapter.disabled():
                save_model(model, folder, tokenizer)
        finally:
            for name, w in kept.items():
                modules[name].weight.copy_(w)
            lora_experts.restore(model, kept_experts)
    return Path(folder)


def load(path, model) -> None:
    """Resume: read the checkpoint's adapter into the live one (refused if not finite, before anything changes)."""
    from safetensors.torch import load_file

    from areno.models.lora import WEIGHTS_FILE

    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    base = Path(path) / BASE_DIR
    fresh = None
    if base.is_dir():  # the base the warm-up trained
        from areno.models import load_model

        p = next(model.parameters())
        fresh = load_model(base, dtype=p.dtype, device=p.device)
        bad += [n for n, q in fresh.named_parameters() if not torch.isfinite(q).all()]
    if bad:
        raise ValueError(f"its weights hold NaN or inf ({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")
    adapter = adapter_of(model)
    adapter.load_weights(path, field="--resume")
    if fresh is not None:
        theirs = dict(fresh.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():  # a QLoRA base's quantised weights are not parameters
                p.copy_(theirs[name])
        adapter.base_changed = True
    nf4 = Path(path) / NF4_BASE_FILE
    if nf4.is_file():
        try:
            qlora.load_nf4_state(model, load_file(str(nf4)))
        except LoraError as e:
            raise ValueError(str(e)) from e
        adapter.quantize_pending = False


def describe(path) -> str:
    """How the final message names a LoRA checkpoint."""
    merged, base = Path(path) / MERGED_DIR, Path(path) / BASE_DIR
    on = f"on {base} (the warm-up's base)" if base.is_dir() else "on --ckpt"
    if merged.is_dir():
        return f"checkpoint: {path} (a PEFT adapter {on}; merged weights: areno serve --model-path {merged})"
    return (f"checkpoint: {path} (a PEFT adapter {on}: peft.PeftModel.from_pretrained reads it; --merge-lora also "
            "writes servable merged weights)")
