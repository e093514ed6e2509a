"""`areno check` (one OK/WARN/FAIL line per readiness check) and `areno env` (the support report)."""

import argparse
import json
import os
import platform as _platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from areno.config.constants import ATTN_BACKENDS  # areno.config imports the standard library only, as this module
from areno.config.env import current_values
from areno.platform import (
    CORE_DEPS,
    CPU_NEXT_STEP,
    CPU_WARNING,
    ENV_VARS,
    MIN_PYTHON,
    MIN_TORCH,
    OPTIONAL_DEPS,
    BackendUnavailable,
    areno_home,
    dependency_version,
    detect_attn_backend,
    driver_version,
    gpu_list,
    nvidia_driver_present,
    read_setup,
    runs_dir,
    select_backend,
    setup_path,
    torch_import_error,
    torch_or_none,
    triton_version,
    wsl_version,
)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2])



@dataclass
class Check:
    status: str  # OK | WARN | FAIL
    name: str
    detail: str
    next_step: str = ""

    def line(self) -> str:
        tail = f" -> {self.next_step}" if self.status != "OK" and self.next_step else ""
        return f"{self.status:<4} {self.name}: {self.detail}{tail}"



def run_probe_kernel(device: str) -> None:
    """Compile and run a tiny Triton kernel (y = 2x + 1) on `device`; raise if it fails or computes wrong values."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _affine(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0 + 1.0, mask=mask)

    x = torch.arange(100, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    _affine[(triton.cdiv(100, 64),)](x, y, 100, BLOCK=64)
    if not torch.equal(y.cpu(), x.cpu() * 2 + 1):
        raise RuntimeError("the probe kernel computed wrong values")


NEXT_TORCH_CUDA = ("install a CUDA build of PyTorch >= 2.6 matching the driver (nvidia-smi shows its CUDA version): "
                   "pip install torch --index-url https://download.pytorch.org/whl/cuXYZ")


def _check_python() -> Check:
    v = sys.version_info
    detail = f"{v.major}.{v.minor}.{v.micro} ({sys.executable})"
    if v[:2] < MIN_PYTHON:
        return Check("FAIL", "python", f"{detail} is older than 3.10", "use Python >= 3.10 (PYTHON=... install.sh)")
    return Check("OK", "python", detail)


def _check_platform(gpus: list[dict]) -> Check:
    """The platform and what runs on it: the CUDA backend with a CUDA device, the native PyTorch path without."""
    system, machine = _platform.system(), _platform.machine()
    try:
        backend = select_backend()
    except BackendUnavailable as e:
        return Check("FAIL", "platform", str(e), "run areno on Linux x86_64/aarch64 with an NVIDIA GPU")
    wsl = " (WSL2)" if system == "Linux" and wsl_version() == 2 else ""
    runs = (f"{backend.upper()} backend" if gpus else
            f"CPU, the native PyTorch path (the {backend.upper()} backend needs an NVIDIA GPU)")
    if machine not in ("x86_64", "aarch64"):
        return Check("WARN", "platform", f"{system} {machine}: {runs} on an untested architecture",
                     "areno is tested on Linux x86_64 and aarch64")
    return Check("OK", "platform", f"{system} {machine}{wsl}: {runs}")


def _check_torch(torch, nvidia: bool) -> Check:
    if torch is None:
        step = NEXT_TORCH_CUDA if nvidia else "run `bash scripts/install.sh` (it installs the CPU build without a GPU)"
        return Check("FAIL", "torch", f"not importable ({torch_import_error()})", step)
    version = torch.__version__
    if _version_tuple(version) < MIN_TORCH:
        return Check("FAIL", "torch", f"{version} is older than 2.6", NEXT_TORCH_CUDA)
    if torch.version.cuda is None:
        if nvidia:
            return Check("FAIL", "torch", f"{version} is a CPU build on a host with an NVIDIA GPU", NEXT_TORCH_CUDA)
        return Check("OK", "torch", f"{version} (CPU build: the native path for tests, the quickstart and tiny models)")
    return Check("OK", "torch", f"{version} (CUDA {torch.version.cuda} build)")


def _check_gpus(torch, gpus: list[dict], nvidia: bool) -> Check:
    if torch is None:
        return Check("WARN", "gpu", "unknown: torch is not importable", "fix torch first")
    if not gpus:
        if nvidia:
            return Check("WARN", "gpu", f"{CPU_WARNING}; an NVIDIA driver is present but torch sees no CUDA device",
                         "check CUDA_VISIBLE_DEVICES, `nvidia-smi`, and that torch's CUDA build matches the driver")
        return Check("WARN", "gpu", CPU_WARNING, CPU_NEXT_STEP)
    listing = "; ".join(f"{g['index']}: {g['name']} (capability {g['capability']}, {g['memory_gib']} GiB)"
                        for g in gpus)
    return Check("OK", "gpu", f"{len(gpus)} visible: {listing}")


def _check_triton(gpus: list[dict]) -> Check:
    version = triton_version()
    if version is None:
        return Check("FAIL", "triton", "not importable", "pip install triton (use the version your torch pins)")
    if gpus:
        t0 = time.perf_counter()
        try:
            run_probe_kernel("cuda")
        except Exception as e:
            return Check("FAIL", "triton", f"{version} cannot run kernels on this GPU ({type(e).__name__}: {e})",
                         "check `nvidia-smi` and that triton matches torch (pip show torch triton)")
        seconds = time.perf_counter() - t0
        return Check("OK", "triton", f"{version}: compiled and ran a test kernel on cuda:0 ({seconds:.1f} s)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        try:
            run_probe_kernel("cpu")
        except Exception as e:
            return Check("WARN", "triton", f"{version}: the interpreter failed a test kernel ({type(e).__name__}: {e})",
                         "check the triton install (pip show triton)")
        return Check("OK", "triton",
                     f"{version}: no CUDA device; a test kernel ran in the interpreter (TRITON_INTERPRET=1)")
    return Check("OK", "triton", f"{version} imported; no CUDA device, so Triton kernels run only under "
                                 "TRITON_INTERPRET=1 (tests); the native path is used otherwise")


def _check_attention() -> Check:
    try:
        record = read_setup()
    except ValueError as e:
        return Check("FAIL", "attention", str(e), "rerun `bash scripts/install.sh`")
    now = detect_attn_backend()
    if record is None:
        return Check("WARN", "attention", f"no setup record at {setup_path()}; runtime default: {now['attn_backend']} "
                     f"({now['reason']})", "run `bash scripts/install.sh` to record it")
    chosen = record.get("attn_backend")
    if chosen not in ATTN_BACKENDS:
        return Check("FAIL", "attention", f"{setup_path()} records attn_backend={chosen!r}",
                     "rerun `bash scripts/install.sh`")
    detail = f"{chosen} (recorded in {setup_path()}: {record.get('reason', '')})"
    if chosen == "flash" and now["attn_backend"] == "native":
        return Check("WARN", "attention", f"{detail}, but this host has {now['reason']}",
                     "rerun `bash scripts/install.sh`, or pass --attn-backend native")
    if chosen == "native" and now["attn_backend"] == "flash":
        return Check("WARN", "attention", f"{detail}, but this host supports flash: {now['reason']}",
                     "rerun `bash scripts/install.sh` to record flash")
    return Check("OK", "attention", detail)


def _check_core_deps() -> Check:
    versions = {dist: dependency_version(dist, mod) for dist, mod in CORE_DEPS.items()}
    missing = [d for d, v in versions.items() if v is None]
    if missing:
        return Check("FAIL", "dependencies", f"missing {', '.join(missing)}",
                     "pip install -e . (or rerun `bash scripts/install.sh`)")
    return Check("OK", "dependencies", ", ".join(f"{d} {v}" for d, v in versions.items()))


def _check_optional_deps() -> list[Check]:
    out = []
    for extra, (deps, consequence) in OPTIONAL_DEPS.items():
        versions = {dist: dependency_version(dist, mod) for dist, mod in deps.items()}
        missing = [d for d, v in versions.items() if v is None]
        if missing:
            out.append(Check("WARN", f"{extra} extra", f"missing {', '.join(missing)}: {consequence}",
                             f"pip install 'areno[{extra}]'"))
        else:
            out.append(Check("OK", f"{extra} extra", ", ".join(f"{d} {v}" for d, v in versions.items())))
    return out


def _check_folder(name: str, path: Path, step: str) -> Check:
    """Create and remove a temp file in `path` (or, if it does not exist yet, in its nearest existing parent)."""
    target = path
    while not target.exists() and target != target.parent:
        target = target.parent
    if not target.is_dir():
        return Check("FAIL", name, f"{path}: {target} is not a folder", step)
    try:
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".areno-check-")
        os.write(fd, b"ok")
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        return Check("FAIL", name, f"{path} is not writable ({e})", step)
    shown = os.path.abspath(path)
    if target == path:
        return Check("OK", name, f"{shown} is writable")
    return Check("OK", name, f"{shown} will be created (under writable {os.path.abspath(target)})")


def collect_checks() -> list[Check]:
    torch = torch_or_none()
    nvidia = nvidia_driver_present()
    gpus = gpu_list(torch)
    steps = [
        _check_python, lambda: _check_platform(gpus), lambda: _check_torch(torch, nvidia),
        lambda: _check_gpus(torch, gpus, nvidia),
        lambda: _check_triton(gpus), _check_attention, _check_core_deps, _check_optional_deps,
        lambda: _check_folder("cache", areno_home(), "set ARENO_HOME to a writable folder"),
        lambda: _check_folder("logs", runs_dir(), "run from a writable folder, or pass --metrics-dir / --save-path"),
    ]
    checks = []
    for step in steps:
        try:
            result = step()
        except Exception as e:  # a broken check must not hide the others
            result = Check("FAIL", getattr(step, "__name__", "check").lstrip("_"), f"the check crashed: {e!r}",
                           "report it with `areno env --json`")
        checks.extend(result if isinstance(result, list) else [result])
    return checks


def check_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areno check", description="Readiness checks, one OK/WARN/FAIL line each.")
    parser.add_argument("--models", action="store_true",
                        help="print the supported-models table (family, model types, TP, routing replay, MTP) instead")
    return parser


def run_check(argv: list[str]) -> int:
    """`areno check`: print one line per check; exit code 1 on any FAIL, else 0 (``--models``: the models table)."""
    if check_parser().parse_args(argv).models:
        from areno.models.registry import supported_models_table

        print(supported_models_table(), end="")
        return 0
    checks = collect_checks()
    for c in checks:
        print(c.line(), flush=True)
    return 1 if any(c.status == "FAIL" for c in checks) else 0


# ---------------------------------------------------------------------------------------------------- env


def env_report() -> dict:
    """Support report: versions, devices, dependency status, relevant environment variables and the setup record."""
    import areno

    system = _platform.system()
    try:
        backend = select_backend()
    except BackendUnavailable as e:
        backend = f"unavailable: {e}"
    torch = torch_or_none()
    torch_info = {"version": None, "cuda": None, "cudnn": None}
    if torch is not None:
        try:
            cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        except Exception:
            cudnn = None
        torch_info = {"version": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn}
    core = {"torch": "torch", "triton": "triton", **CORE_DEPS}
    deps = {"core": {d: dependency_version(d, m) for d, m in core.items()}}
    for extra, (extra_deps, _) in OPTIONAL_DEPS.items():
        deps[extra] = {d: dependency_version(d, m) for d, m in extra_deps.items()}
    env = {k: os.environ.get(k) for k in ENV_VARS}
    env.update({k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")})
    try:
        setup = read_setup()
    except ValueError as e:
        setup = {"error": str(e)}
    wsl = wsl_version() if system == "Linux" else None
    return {
        "areno": {"version": areno.__version__, "path": str(Path(areno.__file__).resolve().parent)},
        "python": {"version": _platform.python_version(), "executable": sys.executable},
        "platform": {"system": system, "release": _platform.release(), "machine": _platform.machine(),
                     "wsl": wsl is not None, "wsl_version": wsl, "backend": backend},
        "torch": torch_info,
        "cuda_available": bool(torch is not None and torch.cuda.is_available()),
        "driver": driver_version(),
        "triton": triton_version(),
        "transformers": deps["core"]["transformers"],
        "safetensors": deps["core"]["safetensors"],
        "accelerate": deps["core"]["accelerate"],
        "datasets": deps["core"]["datasets"],
        "gpus": gpu_list(torch),
        "dependencies": deps,
        "env": env,
        "setup": setup,
        "setup_path": str(setup_path()),
        "areno_variables": current_values(),  # every ARENO_* variable: value here, default, meaning
    }


def _print_text(value, indent: int = 0) -> None:
    pad = "  " * indent
    for key, item in value.items():
        if isinstance(item, dict) and item:
            print(f"{pad}{key}:")
            _print_text(item, indent + 1)
        elif isinstance(item, list) and item:
            print(f"{pad}{key}:")
            for entry in item:
                if isinstance(entry, dict):
                    print(f"{pad}  - " + ", ".join(f"{k}: {v}" for k, v in entry.items()))
                else:
                    print(f"{pad}  - {entry}")
        else:
            print(f"{pad}{key}: {'none' if item in (None, {}, []) else item}")


def run_env(argv: list[str]) -> int:
    """`areno env [--json]`: the support report as JSON, or as readable text."""
    parser = argparse.ArgumentParser(prog="areno env", description="Environment report for bug reports and support.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = env_report()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_text({k: v for k, v in report.items() if k != "areno_variables"})
        print("areno_variables:")  # the table of areno.config.env, with the values here
        for v in report["areno_variables"]:
            print(f"  {v['name']}: {'unset' if v['value'] is None else v['value']} (default: {v['default']}): "
                  f"{v['meaning']}")
    return 0


# ------------------------------------------------------------------------------------------------- warmup

