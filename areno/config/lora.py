"""The LoRA part of `areno train`'s `train` group: a low-rank adapter trained on the frozen base (PEFT's format)."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.fields import ConfigError, check_non_negative, check_range, flag_name, opt

QUANTIZE_BASE = ("none", "nf4")


@dataclass
class LoraSection:
    """`--help` group train, LoRA part (its checks read the basic, rollout and optim sections)."""

    lora_rank: int = opt(0, "LoRA rank: train a PEFT-compatible low-rank adapter on the frozen base, the reference "
                         "model being the base with the adapter off (an --sft-warmup-steps warm-up trains the base "
                         "itself first, the adapter off; checkpoints then hold that base too) (0 = full-parameter "
                         "training)", "train")
    lora_alpha: Optional[float] = opt(None, "LoRA alpha (the adapter's output is scaled by alpha / rank)", "train",
                                      default_help="2 x --lora-rank", needs="lora")
    lora_dropout: float = opt(0.0, "dropout on the LoRA input (PEFT's lora_dropout)", "train", needs="lora")
    lora_target_modules: str = opt(
        "all-linear", "comma-separated PEFT module names to adapt (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
        "down_proj, ...; a name matches a module or its dotted suffix; MoE routed experts as PEFT's "
        "target_parameters experts.gate_up_proj,experts.down_proj, or experts for both), or all-linear (every linear "
        "layer but lm_head; not the routed experts)", "train", needs="lora")
    lora_path: Optional[str] = opt(None, "start from this PEFT LoRA adapter folder (adapter_config.json + "
                                   "adapter_model.safetensors; its rank, alpha and target modules are the run's)",
                                   "train", metavar="DIR", needs="lora")
    merge_lora: bool = opt(False, "each checkpoint also holds the merged full weights in <checkpoint>/merged "
                           "(loadable by transformers and areno serve) beside the adapter; with --quantize-base nf4 "
                           "the adapter is merged into the dequantised base weights", "train", needs="lora")
    quantize_base: str = opt("none", "QLoRA: nf4 holds the frozen base's linear layers (all of the language model's "
                             "but lm_head; embeddings and norms stay) in 4-bit NormalFloat with double-quantised "
                             "scales (bitsandbytes' format, block 64), quantised at load (after an --sft-warmup-steps "
                             "warm-up, which trains the base itself), the forward through an NF4 GEMM; training, "
                             "rollout and the reference (the adapter off) share it; none keeps the base in --dtype",
                             "train", choices=QUANTIZE_BASE, needs="lora")

    def check_lora(self):
        check_non_negative("--lora-rank", self.lora_rank)
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError("--lora-alpha", f"must be > 0, got {self.lora_alpha}")
        check_range("--lora-dropout", self.lora_dropout, 0.0, 1.0, high_open=True)
        if not [t for t in str(self.lora_target_modules).split(",") if t.strip()]:
            raise ConfigError("--lora-target-modules", "names no module")
        if self.quantize_base not in QUANTIZE_BASE:
            raise ConfigError("--quantize-base", f"must be one of {', '.join(QUANTIZE_BASE)}, got "
                              f"{self.quantize_base!r}")
        if not self.lora_rank:
            return
        if self.quantize_base == "nf4":
            self.check_qlora()
        experts = [t.strip() for t in str(self.lora_target_modules).split(",") if "experts" in t.strip().split(".")]
        if experts and (self.rollout_devices is not None or self.tp_size > 1):
            what = "split mode (--rollout-devices)" if self.rollout_devices is not None else "--tp-size > 1"
            raise ConfigError("--lora-target-modules", f"{experts[0]}: LoRA on MoE experts with {what} is not built "
                              "yet; train colocated without tensor parallelism")
        if self.tp_size > 1 and self.lora_dropout > 0:
            raise ConfigError("--lora-dropout", "with --tp-size > 1 is not built yet (each rank would draw its own "
                              "mask over the replicated input); use 0")
        if self.train_cuda_graphs == "on":
            raise ConfigError("--train-cuda-graphs", "on with --lora-rank is not built yet (the adapter's update is "
                              "not graphed); use auto or off")
        for name in ("unfreeze_mm_tower", "unfreeze_mm_projector"):
            if getattr(self, name):
                raise ConfigError(flag_name(name), "with --lora-rank is not built yet (the adapter trains the "
                                  "language model's projections; the tower and projector stay frozen)")
        if self.merge_lora and not self.save_path:
            raise ConfigError("--merge-lora", "writes merged weights into each checkpoint: set --save-path")

    def check_qlora(self):
        """--quantize-base nf4: the combinations not built yet, refused in one line."""
        unbuilt = {"split mode (--rollout-devices)": (self.rollout_devices is not None, "the rollout engine holds "
                                                      "its own copy of the base; train colocated"),
                   "--tp-size > 1": (self.tp_size > 1, "NF4 weights sharded with their layers"),
                   "--train-cuda-graphs on": (self.train_cuda_graphs == "on", "use auto or off")}
        for what, (given, why) in unbuilt.items():
            if given:
                raise ConfigError("--quantize-base", f"nf4 with {what} is not built yet ({why})")
