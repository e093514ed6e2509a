"""Where each `areno train` flag applies: the algorithms and conditions its `opt(algos=..., needs=...)` declares, and
the checks that refuse a flag given where it does not apply (a `ConfigError` naming it)."""

from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import NamedTuple

from areno.config.constants import ALGOS, RL_ALGOS
from areno.config.fields import ConfigError, flag_name


def _split(v):
    return v["rollout_devices"] is not None


def _rollout(v):
    return v["algo"] in RL_ALGOS or bool(v["reward_fn_path"]) or bool(v["agent_fn"])


def _reference(v):
    return v["algo"] == "dpo" or v["kl_coef"] > 0


def _correction(v):
    return v["algo"] != "gspo" or v["off_policy_correction"] == "seq-tis"


def _tis(v):
    kind = v["off_policy_correction"]
    return kind == "seq-tis" or (kind == "tis" and v["algo"] != "gspo")


class Condition(NamedTuple):
    """A ``needs=`` condition: whether it holds for the run's values, the refusal (after the flag) and the phrase
    `--help` adds ("applies ..."). A mode condition is a setting of the run: TrainConfig refuses a value other than the
    default without it; the others are checked on the flags given (the CLI's, the SDK's keyword arguments)."""

    holds: Callable[[dict], bool]
    refusal: str
    help: str
    mode: bool = False


CONDITIONS = {
    "split": Condition(_split, "applies to split mode only (--train-devices and --rollout-devices)", "in split mode",
                       True),
    "async": Condition(lambda v: _split(v) and v["max_staleness"] > 0, "applies only in split mode with "
                       "--max-staleness >= 1 (with 0 every rollout waits for the new policy: no generation is in "
                       "flight when it arrives)", "in split mode with --max-staleness >= 1", True),
    "partial": Condition(lambda v: _split(v) and bool(v["partial_rollout"]), "applies only with --partial-rollout "
                         "(split mode)", "with --partial-rollout", True),
    "agent": Condition(lambda v: bool(v["agent_fn"]), "applies to agentic rollout only (--agent-fn)", "with --agent-fn",
                       True),
    "tower": Condition(lambda v: bool(v["unfreeze_mm_tower"]), "applies only with --unfreeze-mm-tower (the tower is "
                       "frozen otherwise)", "with --unfreeze-mm-tower", True),
    "projector": Condition(lambda v: bool(v["unfreeze_mm_projector"]), "applies only with --unfreeze-mm-projector "
                           "(the projector is frozen otherwise)", "with --unfreeze-mm-projector", True),
    "disk": Condition(lambda v: v["optimizer_state_offload"] == "disk", "applies only to --optimizer-state-offload "
                      "disk", "with --optimizer-state-offload disk", True),
    "nodes": Condition(lambda v: (v["nnodes"] or 1) > 1, "applies only with --nnodes > 1 (a run started by hand on "
                       "several nodes)", "with --nnodes > 1", True),
    "saved": Condition(lambda v: bool(v["save_path"]), "needs --save-path", "with --save-path", True),
    "rollout": Condition(_rollout, "does not apply to --algo {algo} without --reward-fn-path: it sets the rollout of "
                         "grpo, gspo and ppo and the greedy held-out evaluation that --reward-fn-path scores",
                         "to grpo, gspo, ppo, and to sft, dpo with --reward-fn-path (held-out evaluation)"),
    "reference": Condition(_reference, "applies only with a reference model (--algo dpo, or --kl-coef > 0)",
                           "with a reference model (dpo, or --kl-coef > 0)"),
    "kl": Condition(lambda v: v["kl_coef"] > 0, "applies only with --kl-coef > 0 (no KL term otherwise)",
                    "with --kl-coef > 0"),
    "warmup": Condition(lambda v: v["sft_warmup_steps"] > 0, "applies only with --sft-warmup-steps > 0",
                        "with --sft-warmup-steps > 0"),
    "lora": Condition(lambda v: v["lora_rank"] > 0, "applies only with --lora-rank > 0 (no adapter otherwise)",
                      "with --lora-rank > 0", True),
    "correction": Condition(_correction, "with --algo gspo only seq-tis is built (GSPO's ratio is sequence-level; the "
                            "token-level corrections are not built for it)", "(gspo: seq-tis only)"),
    "tis": Condition(_tis, "applies only with --off-policy-correction tis or seq-tis (seq-tis with --algo gspo)",
                     "with --off-policy-correction tis or seq-tis"),
    "is_mask": Condition(lambda v: v["off_policy_correction"] in ("mask", "icepop"), "applies only with "
                         "--off-policy-correction mask or icepop", "with --off-policy-correction mask or icepop"),
    "surrogate": Condition(lambda v: v["off_policy_correction"] != "cispo", "does not apply with "
                           "--off-policy-correction cispo (its clipped IS weight bounds every token already)",
                           "without --off-policy-correction cispo"),
    "evalsets": Condition(lambda v: bool(v["eval_dataset_path"]), "applies only with --eval-dataset-path",
                          "with --eval-dataset-path"),
    "wandb": Condition(lambda v: bool(v["wandb_project"]), "applies only with --wandb-project", "with --wandb-project"),
    "speculative": Condition(lambda v: _rollout(v) and v["speculative_tokens"] > 0, "applies only with "
                             "--speculative-tokens > 0", "with --speculative-tokens > 0", True),
    "epochs": Condition(lambda v: v["max_steps"] is None, "does not apply with --max-steps (which sets the run's "
                        "length; --epochs counts passes over the data otherwise)", "without --max-steps"),
}


def declared(f) -> tuple[tuple[str, ...], str | None]:
    """A field's declaration: the algorithms it applies to (all by default) and its condition (or None)."""
    return tuple(f.metadata.get("algos", ALGOS)), f.metadata.get("needs")


def refusal(f, values: dict, *, by_algo=True, mode_only=False) -> str | None:
    """Why field ``f`` does not apply to the run ``values`` describes (field name -> value), or None.
    ``by_algo``: check its algorithms; ``mode_only``: of the conditions, only the mode ones."""
    algos, needs = declared(f)
    algo = values["algo"]
    if by_algo and algo in ALGOS and algo not in algos:
        return f"does not apply to --algo {algo} (it is used by: {', '.join(algos)})"
    if needs is None:
        return None
    condition = CONDITIONS[needs]
    if mode_only and not condition.mode:
        return None
    try:
        if condition.holds(values):
            return None
    except TypeError:  # a value of the wrong type: the field's own check says so
        return None
    return condition.refusal.format(algo=algo)


def help_note(f) -> str:
    """What `--help` says of where ``f`` applies: '' for everywhere, else e.g. ' [applies to ppo]'."""
    algos, needs = declared(f)
    parts = ([f"to {', '.join(algos)}"] if algos != ALGOS else []) + ([CONDITIONS[needs].help] if needs else [])
    return f" [applies {' '.join(parts)}]" if parts else ""


def config_fields(cls) -> dict:
    return {f.name: f for f in fields(cls)}


def check_given(cls, values: dict, given) -> None:
    """``ConfigError`` for the first flag of ``given`` (field names) that does not apply to the run ``values``
    describes (every field of ``cls``)."""
    if "algo" not in values:  # areno serve: one kind of run
        return
    by_name = config_fields(cls)
    for name in given:
        reason = refusal(by_name[name], values) if name in by_name else None
        if reason:
            raise ConfigError(flag_name(name), reason)


def check_set(config) -> None:
    """TrainConfig's own check, on the values (the CLI and the SDK check the flags given with `check_given`): a field
    away from its default must meet its mode condition, and its algorithms where its default is None (an optional
    input set) or it has a mode condition (a setting of that mode)."""
    values = {f.name: getattr(config, f.name) for f in fields(config)}
    for f in fields(config):
        if f.default is MISSING or values[f.name] == f.default:
            continue
        needs = declared(f)[1]
        moded = needs is not None and CONDITIONS[needs].mode
        reason = refusal(f, values, by_algo=f.default is None or moded, mode_only=True)
        if reason:
            raise ConfigError(flag_name(f.name), reason)


def drop_inapplicable(cls, values: dict, keep) -> list[str]:
    """Reset to its default each field of ``values`` not in ``keep`` (a preset's own setting, not a flag given) that
    does not apply to the run; returns their flags. Repeats until none is left (a dropped --agent-fn drops the
    agentic settings too)."""
    dropped = []
    changed = True
    while changed:
        changed = False
        for name, f in config_fields(cls).items():
            if name in keep or f.default is MISSING or values[name] == f.default:
                continue
            if refusal(f, values):
                values[name] = f.default
                dropped.append(flag_name(name))
                changed = True
    return dropped
