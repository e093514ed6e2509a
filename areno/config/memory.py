"""The `memory` section of `areno train`: rollout state, activation checkpointing, offload, KV budget."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.constants import OFFLOAD_MODES, OPTIMIZER_STATES, RL_ALGOS
from areno.config.fields import ConfigError, check_choice, check_memory, check_offload, flag_name, memory_amount, opt


@dataclass
class MemorySection:
    """`--help` group memory."""

    drop_rollout_state: bool = opt(False, "release KV cache and graphs at each rollout session boundary", "memory",
                                   algos=RL_ALGOS)
    activation_checkpointing: bool = opt(True, "recompute decoder activations during backward", "memory")
    optimizer_states: str = opt(
        "fp32", "AdamW's moments (exp_avg, exp_avg_sq): fp32, or 8bit (blockwise dynamic quantisation, 256-element "
        "blocks with an fp32 absmax each: ~2 bytes per parameter instead of 8; fp32 master weights kept; "
        "full-parameter and LoRA runs, ZeRO-1 shards them; the optimizer step stays eager under "
        "--train-cuda-graphs)", "memory", choices=OPTIMIZER_STATES)
    optimizer_state_offload: str = opt("none", "where optimizer state lives between train calls", "memory",
                                       choices=OFFLOAD_MODES)
    optimizer_state_offload_dir: Optional[str] = opt(
        None, "folder for --optimizer-state-offload disk (scratch files, not a checkpoint)", "memory", metavar="DIR",
        needs="disk")
    optimizer_state_offload_batch_size: int = opt(1, "mmap files grouped per flush for disk offload", "memory",
                                                  needs="disk")
    kv_cache_memory: Optional[float] = opt(
        None, "KV-cache budget: a fraction of free GPU memory (0.9) or a size (40GiB)", "memory",
        type=memory_amount, metavar="AMOUNT", default_help="the runtime decides", needs="rollout")


    def check_memory_section(self):
        check_offload(flag_name, self.optimizer_state_offload, self.optimizer_state_offload_dir,
                      self.optimizer_state_offload_batch_size)
        check_memory("--kv-cache-memory", self.kv_cache_memory)
        check_choice("--optimizer-states", self.optimizer_states, OPTIMIZER_STATES)
        if self.optimizer_states == "8bit" and self.optimizer_state_offload != "none":
            raise ConfigError("--optimizer-states", "8bit with --optimizer-state-offload "
                              f"{self.optimizer_state_offload} is not built yet (the 8-bit moments stay on the "
                              "device); use one of the two")
