"""Command lines for the flag tests: a valid value other than the default for every `areno train` flag, and the flags
that make a run where a flag's declared condition (areno.config.applies.CONDITIONS) holds or does not."""

import dataclasses
from pathlib import Path

from areno.config import TrainConfig, flag_name
from areno.config.constants import RL_ALGOS

# values that differ from the default and pass the flag's own check (the generic "2" does not fit these)
VALUES = {
    "min_lr": "1e-7", "mm_tower_min_lr": "1e-7", "mm_projector_min_lr": "1e-7", "clip_eps_low": "0.1",
    "gspo_clip_eps": "0.001", "dpo_label_smoothing": "0.1", "gamma": "0.9", "gae_lambda": "0.9", "top_p": "0.9",
    "min_p": "0.1", "tis_cap": "3", "kv_cache_memory": "0.5", "train_devices": "0", "rollout_devices": "1",
    "rollout_tp_size": "1",
    "stop": "END", "resume": "some/step-1", "routing_replay": "off", "train_cuda_graphs": "off", "world_size": "2",
    "ckpt": "other-model", "ref_ckpt": "ref-model", "critic_ckpt": "critic-model", "dataset_path": "other.jsonl",
    "lora_dropout": "0.1", "lora_target_modules": "q_proj,v_proj", "is_mask_low": "0.2", "is_mask_high": "3",
    "wandb_mode": "offline", "node_rank": "1", "master_addr": "node0",
}
FILES = {"dataset_loader_fn": "loader", "reward_fn_path": "reward", "agent_fn": "agent", "eval_dataset_path": "reward"}
FOLDERS = ("save_path", "metrics_dir", "rollout_dump_dir", "optimizer_state_offload_dir")
# flags that take other flags to be valid at all (not where they apply: what their own value check asks)
COMPANIONS = {"tp_size": ["--world-size", "2"], "rollout_devices": ["--train-devices", "0"],
              "merge_lora": ["--save-path", "lora-out"]}
# companions given after the flag (where they do not apply either, the refusal names the flag first)
AFTER = {"speculative_tokens": ["--decode-steps", "1"]}


@dataclasses.dataclass
class Files:
    """The plugin files and a scratch folder a command line may name."""

    root: Path

    def __post_init__(self):
        (self.root / "loader.py").write_text("def load_training_dataset(path, *, default_loader, **kwargs):\n"
                                             "    return []\n")
        (self.root / "reward.py").write_text("def reward_fn(record):\n    return 0.0\n")
        (self.root / "agent.py").write_text("async def run_agent(ctx, batch):\n    return []\n")

    def __getitem__(self, key) -> str:
        return str(self.root / f"{key}.py")


def train_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if f.name not in ("preset", "algo")]


def flag_argv(f: dataclasses.Field, files: Files) -> list[str]:
    """``f``'s flag with a valid value other than its default (and what that value itself needs)."""
    name = f.name
    if f.type is bool:
        return [*COMPANIONS.get(name, []), flag_name(name) if not f.default else f"--no-{name.replace('_', '-')}"]
    if name in FILES:
        value = files[FILES[name]]
    elif name in FOLDERS:
        value = str(files.root / name)
    elif name in VALUES:
        value = VALUES[name]
    elif f.metadata.get("choices"):  # the first other choice (--optimizer-state-offload: cpu; disk needs a folder)
        value = str(next(c for c in f.metadata["choices"] if c != f.default))
    else:
        value = "2"
    return [*COMPANIONS.get(name, []), flag_name(name), value, *AFTER.get(name, [])]


def condition_argv(needs: str | None, algo: str, files: Files) -> list[str]:
    """Flags that make the condition ``needs`` hold for ``algo`` (where it can)."""
    return {
        None: [], "epochs": [], "rollout": [],  # the base command line already gives --reward-fn-path
        "split": ["--train-devices", "0", "--rollout-devices", "1"],
        "async": ["--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "1"],
        "partial": ["--train-devices", "0", "--rollout-devices", "1", "--max-staleness", "1", "--partial-rollout"],
        "agent": ["--agent-fn", files["agent"]],
        "tower": ["--unfreeze-mm-tower"], "projector": ["--unfreeze-mm-projector"],
        "disk": ["--optimizer-state-offload", "disk", "--optimizer-state-offload-dir", str(files.root / "offload")],
        "saved": ["--save-path", str(files.root / "save_path")],
        "reference": [] if algo == "dpo" else ["--kl-coef", "0.1"], "kl": ["--kl-coef", "0.1"],
        "warmup": ["--sft-warmup-steps", "2"], "lora": ["--lora-rank", "4"],
        "correction": [], "surrogate": [], "is_mask": ["--off-policy-correction", "mask"],
        "tis": ["--off-policy-correction", "seq-tis"] if algo == "gspo" else [],
        "evalsets": ["--eval-dataset-path", files["reward"]], "wandb": ["--wandb-project", "p"],
        "nodes": ["--nnodes", "2"],
        "speculative": ["--speculative-tokens", "2", "--decode-steps", "1"],
    }[needs]


def base_argv(algo: str, files: Files, *, reward=True) -> list[str]:
    """A valid `areno train` command line for ``algo`` (a reward function: RL needs one, SFT/DPO evaluate with it)."""
    argv = ["train", "--ckpt", "m", "--dataset-path", "d.jsonl", "--algo", algo]
    return argv + (["--reward-fn-path", files["reward"]] if reward or algo in RL_ALGOS else [])


def merged(argv: list[str], extra: list[str]) -> list[str]:
    """``argv`` + ``extra`` with a flag of ``extra`` that ``argv`` already has (and its value) taken from ``extra``."""
    names = {a for a in extra if a.startswith("--")}
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in names:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out + extra
