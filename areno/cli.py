"""The `areno` command: `train`, `serve`, `eval`, `check`, `env` (also `python -m areno`).

`train`, `serve` and `eval` build their parser from the config dataclasses in `areno.config` (argparse-dataclass, plus
the few things it lacks: `--help` groups, `--x/--no-x` for every bool, and knowing which flags were given explicitly,
which `--preset` needs). They validate (flags, then the model folder or hub id they name), print one summary line
(the whole resolved configuration with `--verbose`; `areno train` always writes it to config.json in its metrics
folder), then hand it to the runtime, imported only then. Errors come last, as one line: a bad flag or input exits 2,
a run that had to stop (`RunError`: every reward failing, a full disk) exits 1. `check` and `env` belong to
`areno.platform.checks`.
"""

import argparse
import dataclasses
import importlib
import re
import sys

import argparse_dataclass

from areno import __version__
from areno.config import (
    GROUPS,
    ConfigError,
    EvalConfig,
    RunError,
    ServeConfig,
    TrainConfig,
    flag_name,
    format_config,
)
from areno.config.applies import check_given, drop_inapplicable, help_note
from areno.config.constants import RL_ALGOS

_METAVARS = {int: "N", float: "X", str: "STR"}


class ConfigParser(argparse_dataclass.ArgumentParser):
    """argparse-dataclass's parser, with three changes made as each field's argument is added:

    - the argument goes into the `--help` group named by the field's `group` metadata;
    - a bool field becomes `--x/--no-x` (argparse-dataclass only offers the form that flips the default);
    - defaults are `argparse.SUPPRESS`, so the namespace holds only the flags given on the command line and the
      dataclass supplies the rest (the default is written into the help text instead).
    """

    def __init__(self, options_class, **kwargs):
        self._fields = {f.name: f for f in dataclasses.fields(options_class)}
        self._sections = None
        super().__init__(options_class, **kwargs)
        # argparse takes "-1e-4" for a flag (its negative-number pattern has no exponent): `--lr -1e-4` must reach
        # the flag's own check ("must be > 0"), not fail as "expected one argument"
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def _section(self, group: str):
        if self._sections is None:  # create every section up front so `--help` follows GROUPS' order
            used = {f.metadata["group"] for f in self._fields.values()}
            self._sections = {g: self.add_argument_group(f"{g} ({about})") for g, about in GROUPS.items() if g in used}
        return self._sections[group]

    def add_argument(self, *args, **kwargs):
        dest = kwargs.get("dest") or (args[0].lstrip("-").replace("-", "_") if args else None)
        f = self._fields.get(dest)
        if f is None:  # -h/--help
            return super().add_argument(*args, **kwargs)
        meta = f.metadata
        if f.type is bool:
            args = (flag_name(f.name),)
            kwargs = {"action": argparse.BooleanOptionalAction}
        else:
            kwargs.pop("required", None)
            for key in ("action", "const"):
                if key in meta:
                    kwargs[key] = meta[key]
            if "choices" not in kwargs and "metavar" not in kwargs:
                kwargs["metavar"] = _METAVARS.get(kwargs.get("type"), "VALUE")
        kwargs.update(dest=f.name, default=argparse.SUPPRESS, help=_help_text(f))
        return self._section(meta["group"]).add_argument(*args, **kwargs)

    def parse_explicit(self, argv) -> dict:
        """The flags given on the command line, as {field name: parsed value}."""
        namespace, extras = argparse.ArgumentParser.parse_known_args(self, argv)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return vars(namespace)


def _help_text(f: dataclasses.Field) -> str:
    meta = f.metadata
    if f.name == "preset":
        from areno.presets import preset_names

        return f"{meta['help']}; presets: {', '.join(preset_names())}"
    if "default_help" in meta:
        default = meta["default_help"]
    elif f.type is bool:
        default = "on" if f.default else "off"
    else:
        default = None if f.default is None else f.default
    text = meta["help"] + help_note(f) + ("" if default is None else f" (default: {default})")
    return text.replace("%", "%%")


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, with a flag's help lines kept where it writes a newline (one line per choice)."""

    def _split_lines(self, text, width):
        lines = []
        for part in text.split("\n"):
            lines += super()._split_lines(part, width)
        return lines


def make_parser(command: str, options_class) -> ConfigParser:
    # A short usage line: errors stay two lines, and `--help` lists every flag in its group anyway.
    # allow_abbrev off: `--max-step 2` is an unknown flag, not silently --max-steps
    return ConfigParser(options_class, prog=f"areno {command}", usage="%(prog)s [-h] [flags]",
                        description=options_class.__doc__, allow_abbrev=False, formatter_class=_HelpFormatter)


def parse_config(parser: ConfigParser, options_class, argv):
    """Parse and validate; a bad value or combination exits 2 with `areno <cmd>: error: --flag ...`."""
    return config_from_explicit(parser, options_class, parser.parse_explicit(argv))


def config_from_explicit(parser: ConfigParser, options_class, explicit: dict):
    """The validated config of the flags given (``parser.parse_explicit``); errors exit 2 through ``parser``."""
    try:
        config = _preset_config(options_class, explicit) if explicit.get("preset") else options_class(**explicit)
        # a flag given where it does not apply (the algorithm, split mode, ...: areno.config.applies) is refused
        check_given(options_class, _values(config), explicit)
        if hasattr(config, "require_run_inputs"):  # a command-line run needs its data (the SDK may not)
            config.require_run_inputs()
        _check_models(config)
        _check_device_indices(config)
        return config
    except ConfigError as e:
        parser.error(str(e))


def _values(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _preset_config(options_class, explicit: dict):
    """``--preset``'s config with the flags given on top. A preset's own setting that does not apply to the run the
    flags make of it (``--algo sft`` on an RL preset: its --n-samples, --temperature, ...) goes back to its default,
    with one line saying so; a preset's overwrite gives way to an explicit --resume."""
    from areno.presets import get_preset

    preset = get_preset(explicit["preset"])
    values = {**_values(preset), **explicit}
    if "resume" in explicit and "overwrite" not in explicit:
        values["overwrite"] = False
    dropped = drop_inapplicable(options_class, values, keep=explicit)
    if dropped:
        print(f"areno train: --preset {explicit['preset']} sets {', '.join(dropped)}, which do not apply to this run: "
              "left at their defaults", file=sys.stderr)
    return options_class(**values)


def _check_models(config) -> None:
    """Every model folder or hub id the config names resolves (a local folder with config.json, or a hub id in the
    cache / downloadable), so a typo is one line naming the flag, not a traceback from deep in the loader."""
    for name in ("ckpt", "ref_ckpt", "critic_ckpt", "model_path"):
        value = getattr(config, name, None)
        if value:
            from areno.models.loader import check_model_source

            check_model_source(flag_name(name), value)
    # the models the rollout engine runs: the served one, the policy of an online algorithm
    engine_model = getattr(config, "model_path", None) or (
        getattr(config, "ckpt", None) if getattr(config, "algo", None) in RL_ALGOS else None)
    if engine_model:
        from areno.models.loader import check_engine_support

        check_engine_support("--model-path" if getattr(config, "model_path", None) else "--ckpt", engine_model)
        from areno.models.loader import check_mtp_support

        for name in ("speculative_tokens", "mtp_loss_weight"):  # the draft these run or train
            if getattr(config, name, 0):
                check_mtp_support(flag_name(name), engine_model)
        if getattr(config, "rollout_dtype", "bf16") == "fp8":  # FP8 shards on the block grid at the engine's TP
            from areno.models.fp8_rollout import check_checkpoint

            check_checkpoint(engine_model, getattr(config, "rollout_tp", None) or config.tp_size)


def _check_device_indices(config) -> None:
    """On a CUDA host every index of --train-devices / --rollout-devices must be a GPU this process sees (on a CPU
    host they name process slots: any index works)."""
    named = [(flag_name(n), getattr(config, n, None)) for n in ("train_devices", "rollout_devices")]
    if not any(devices for _, devices in named):
        return
    import torch

    if not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    for flag, devices in named:
        missing = [d for d in devices or () if d >= count]
        if missing:
            raise ConfigError(flag, f"names GPU {missing[0]}, but this machine has {count} (indices 0..{count - 1}, "
                              "after CUDA_VISIBLE_DEVICES)")


def _summary(command: str, config) -> str:
    if command == "eval":
        names = ", ".join(name for name, _ in config.datasets)
        return (f"areno eval: {config.model_path} on {names}, {config.n_samples} samples per prompt at temperature "
                f"{config.temperature}, seed {config.seed}")
    if command == "serve":
        return (f"areno serve: {config.model_path} on {config.host}:{config.port}, world size {config.world_size}, "
                f"TP {config.tp_size} (--verbose prints the whole configuration)")
    steps = (f"{config.max_steps} step{'s' * (config.max_steps != 1)}" if config.max_steps
             else f"{config.epochs} epoch{'s' * (config.epochs != 1)}")
    saved = f", checkpoints go to {config.save_path}" if config.save_path else ", nothing saved (no --save-path)"
    where = f"{config.metrics_folder}/config.json"
    return (f"areno train: {config.algo} on {config.ckpt}, {steps}{saved}; the resolved configuration goes to "
            f"{where}{'' if config.verbose else ' (--verbose prints it)'}")


def _claimable(parser: ConfigParser, config, explicit: dict):
    """A train run's folders, checked before the summary says where the run goes: a --save-path in use or holding
    what the run may not replace is refused here, with nothing created (``run_dir.check``; the run claims it under
    its lock again); a preset's own ``overwrite`` replaces only that preset's previous run. A run naming neither
    --save-path nor --metrics-dir gets its own runs/<date>-<time>-<pid>."""
    if not isinstance(config, TrainConfig):
        return config
    from areno.training import run_dir

    try:
        if config.save_path:
            preset_only = config.preset if config.overwrite and "overwrite" not in explicit \
                else None
            run_dir.check(config.save_path, resume=bool(config.resume), overwrite=config.overwrite,
                          preset_only=preset_only)
        return run_dir.default_metrics_folder(config)
    except ConfigError as e:
        parser.error(str(e))


def _run_config_command(command, options_class, argv, module, name) -> int:
    parser = make_parser(command, options_class)
    explicit = parser.parse_explicit(argv)
    config = _claimable(parser, config_from_explicit(parser, options_class, explicit), explicit)
    print(_summary(command, config), flush=True)
    if config.verbose:
        print(f"areno {command}: resolved configuration\n{format_config(config)}", flush=True)
    run = getattr(importlib.import_module(module), name)  # the runtime, imported only now (--help stays fast)
    try:
        rc = run(config)
    except ConfigError as e:  # found by the runtime before any work: a bad plugin file, dataset, ...
        print(f"areno {command}: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:  # the run stopped on its own terms; what could be saved is saved
        print(f"areno {command}: error: {e}", file=sys.stderr)
        return 1
    return rc if isinstance(rc, int) else 0


def run_train(argv) -> int:
    return _run_config_command("train", TrainConfig, argv, "areno.rl.runner", "run_train")


def run_serve(argv) -> int:
    return _run_config_command("serve", ServeConfig, argv, "areno.serve.server", "run_server")


def run_eval(argv) -> int:
    return _run_config_command("eval", EvalConfig, argv, "areno.rl.eval_command", "run_eval")


def _platform_command(name):
    def run(argv) -> int:
        return getattr(importlib.import_module("areno.platform.checks"), name)(list(argv))

    return run


COMMANDS = {
    "train": (run_train, "train a policy: SFT, DPO, GRPO, GSPO or PPO"),
    "serve": (run_serve, "serve a model behind an OpenAI-compatible HTTP API"),
    "eval": (run_eval, "evaluate a model: avg@K, pass@k, maj@K with 95%% intervals on datasets"),
    "check": (_platform_command("run_check"), "readiness checks, one OK/WARN/FAIL line each"),
    "env": (_platform_command("run_env"), "environment report for support (--json for JSON)"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areno", description="areno: a self-contained LLM post-training toolkit.")
    parser.add_argument("--version", action="version", version=f"areno {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for name, (_, about) in COMMANDS.items():
        sub.add_parser(name, help=about, add_help=False)
    return parser


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["train"]:  # the program: the run in a child that reports whether it finished
        from areno.distributed.supervise import as_supervised

        rc = as_supervised(sys.argv[1:])
        if rc is not None:
            return rc
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][0](argv[1:])
    parser = _top_parser()
    parser.parse_args(argv)  # --help, --version and unknown commands exit here
    parser.error("a command is required")


if __name__ == "__main__":
    sys.exit(main())
