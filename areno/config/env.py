"""The one table of every ARENO_* environment variable areno reads (name, default, meaning, readers), its accessor
`env_value`, and the Markdown of docs/env.md (`python -m areno.config.env > docs/env.md` regenerates it)."""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # what applies when it is unset, in words
    meaning: str
    readers: str  # the modules that read it (under areno/)


VARIABLES = (
    EnvVar("ARENO_HOME", "$XDG_CACHE_HOME/areno, else ~/.cache/areno",
           "areno's cache folder: the attention-setup record scripts/install.sh writes (setup.json) and the "
           "quickstart checkpoints and data, the quickstart's cached warm-up", "platform, quickstart, rl/warmup_cache"),
    EnvVar("ARENO_WARMUP_CACHE", "on", "off: `areno train --preset quickstart` trains its SFT warm-up every time "
           "instead of reusing the post-warm-up state an earlier run with the same inputs cached under "
           "$ARENO_HOME/warmup/ (bit-identical either way)", "rl/warmup_cache"),
    EnvVar("ARENO_KERNELS", "auto", "native forces the PyTorch path of every kernel, triton forces Triton; auto: "
           "Triton for CUDA tensors (and CPU ones under TRITON_INTERPRET=1), native otherwise",
           "kernels/dispatch (kernels/warmup sets it)"),
    EnvVar("ARENO_AUTOTUNE", "on", "off gives every autotuned kernel only the first (measured best) config of its "
           "list: nothing is benchmarked, for correctness runs on a fresh machine", "kernels/dispatch"),
    EnvVar("ARENO_MLA_CACHE", "expanded", "Ling 3 (bailing_hybrid) MLA KV-cache layout: expanded, or latent (21x "
           "less cache memory a token), read when the model is built", "models/bailing_hybrid"),
    EnvVar("ARENO_API_KEY", "unset", "the bearer token `areno serve` requires when --api-key is not given (vLLM's "
           "VLLM_API_KEY; unlike the flag it does not show in the process list)", "config/serve"),
    EnvVar("ARENO_SERVE_GRACEFUL_SHUTDOWN_S", "30", "seconds `areno serve` lets in-flight requests finish after "
           "SIGTERM/SIGINT before it aborts the rest (>= 0)", "serve/server"),
    EnvVar("ARENO_TRACE_STEPS_MS", "unset", "N: `areno serve` logs every engine step slower than N ms and every "
           "Triton kernel compiled while serving", "serve/replicas"),
    EnvVar("ARENO_VERIFY_POLICY_SYNC", "unset", "1: split mode fetches the rollout engines' weights after every "
           "policy sync and compares them exactly (debugging)", "rl/rollout/remote"),
    EnvVar("ARENO_RANK_TIMEOUT_S", "300", "seconds a rank of a multi-process `areno train` run (--world-size > 1, "
           "split mode) may go silent (stopped, hung) before the run ends naming it; 0 waits for ever",
           "distributed/watchdog"),
    EnvVar("ARENO_TRAIN_CONFIG", "set by areno train", "internal: the resolved TrainConfig as JSON, handed to the "
           "worker processes `areno train` launches", "rl/runner, distributed/worker"),
    EnvVar("ARENO_RUN_STATUS", "set by areno train", "internal: the folder where each process of a run records its "
           "orderly exit, so a run ended by os._exit or a signal is reported as unfinished", "distributed/supervise, "
           "distributed/launch"),
    EnvVar("ARENO_SERVE_CONFIG", "set by areno serve", "internal: the resolved ServeConfig as JSON, handed to the "
           "TP worker processes `areno serve` launches", "serve/server, serve/tp_worker"),
)
TABLE = {v.name: v for v in VARIABLES}


def env_value(name: str) -> str | None:
    """The value of the ARENO_* variable ``name`` (None when unset); a name missing from the table is a KeyError."""
    if name not in TABLE:
        raise KeyError(f"{name} is not in areno.config.env.VARIABLES: add it there (name, default, meaning, readers)")
    return os.environ.get(name)


def current_values() -> list[dict]:
    """The table with each variable's value here (`areno env`)."""
    return [{"name": v.name, "value": os.environ.get(v.name), "default": v.default, "meaning": v.meaning}
            for v in VARIABLES]


def markdown() -> str:
    """docs/env.md: the table as Markdown."""
    rows = [f"| `{v.name}` | {v.default} | {v.meaning} | {v.readers} |" for v in VARIABLES]
    return "\n".join([
        "# Environment variables", "",
        "Every `ARENO_*` variable areno reads. Generated from `areno/config/env.py` by "
        "`python -m areno.config.env > docs/env.md`; `areno env` prints them with their values on this machine.", "",
        "| variable | default | meaning | read by (under `areno/`) |", "| --- | --- | --- | --- |", *rows, ""])


if __name__ == "__main__":
    print(markdown(), end="")
