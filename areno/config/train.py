"""`TrainConfig`: the flags of `areno train`, one flat dataclass composed from the section dataclasses.

Each field is one CLI flag (`--field-name`); its metadata carries the help text, the `--help` group and, where
needed, `choices`, `type`, `action`, `nargs`/`const` and `default_help`. `areno.cli` builds the parser from these
fields with argparse-dataclass, so this package is the single source of truth for flag names, defaults and checks.
Each section (one module per `--help` group: basic, rollout, train = optim + rl, memory, checkpoint, multimodal,
observability) holds its fields and its check method; `__post_init__` runs them all before any work starts and
raises `ConfigError` naming the flag. Where a field applies (its algorithms, split mode, agentic rollout, ...) is
declared in its metadata (`algos=`, `needs=`) and checked by `areno.config.applies`. Imports nothing heavy: the
CLI, `--help` and the SDK's argument checks must stay fast.
"""

from dataclasses import dataclass

from areno.config.applies import check_set
from areno.config.basic import BasicSection
from areno.config.checkpoint import CheckpointSection
from areno.config.cluster import ClusterSection
from areno.config.lora import LoraSection
from areno.config.memory import MemorySection
from areno.config.multimodal import MultimodalSection
from areno.config.observability import ObservabilitySection
from areno.config.optim import OptimSection
from areno.config.rl import RLSection
from areno.config.rollout import RolloutSection, normalize_devices


# dataclass fields come base-last-first: this order of bases keeps the fields (and config.json's keys) in --help's
# group order, basic first
@dataclass
class TrainConfig(ObservabilitySection, MultimodalSection, CheckpointSection, MemorySection, LoraSection, RLSection,
                  OptimSection, RolloutSection, ClusterSection, BasicSection):
    """`areno train`: one RL/SFT/DPO run."""

    def __post_init__(self):
        normalize_devices(self)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.train_devices is not None and self.world_size == 1:
            self.world_size = len(self.train_devices)  # the world size is the train list's length
        self.check_basic()
        check_set(self)  # a setting where it does not apply (the algorithms and modes each field declares)
        self.check_rollout()
        self.check_optim()
        self.check_lora()
        self.check_rl()
        self.check_memory_section()
        self.check_checkpoint()
        self.check_cluster()
        self.check_multimodal()
        self.check_observability()
