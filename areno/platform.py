"""Platform and readiness: backend selection, the attention-setup record, `areno check`, `areno env` and the
Triton warm-up that scripts/install.sh runs.

Only the standard library is imported at the top, so the installer can run this module before torch exists
(``python -m areno.platform record-setup --dry-run``); torch and triton are imported inside functions.

    python -m areno.platform check            # one OK/WARN/FAIL line per check, exit 1 on any FAIL
    python -m areno.platform env [--json]     # support report
    python -m areno.platform warmup           # compile and cache the Triton kernels (GPU)
    python -m areno.platform record-setup     # detect and record the attention setup (install.sh step 7)
    python -m areno.platform installed REPO   # exit 0 when areno is installed from REPO, requirements met (step 5)
"""

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform as _platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from areno.config.constants import ATTN_BACKENDS  # areno.config imports the standard library only, as this module
from areno.config.env import current_values, env_value

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 6)
FLASH_MIN_CAPABILITY = (8, 0)  # the Triton flash-attention kernels target Ampere and newer
CPU_WARNING = "no CUDA device: the native PyTorch path runs on the CPU (tests, the quickstart and tiny models)"
# The gpu check's next step on a CPU host: the CPU really trains and serves the quickstart, a GPU is for real sizes.
CPU_NEXT_STEP = "for real model sizes, use a Linux host with an NVIDIA GPU"

# distribution name -> import name
CORE_DEPS = {
    "transformers": "transformers",
    "safetensors": "safetensors",
    "einops": "einops",
    "accelerate": "accelerate",
    "datasets": "datasets",
    "argparse-dataclass": "argparse_dataclass",
    "tqdm": "tqdm",
}
OPTIONAL_DEPS = {
    "serve": ({"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus-client": "prometheus_client"},
              "`areno serve` cannot start"),
    "math": ({"math-verify": "math_verify"}, "the math_verify reward cannot run"),
}
ENV_VARS = (
    "CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRITON_INTERPRET",
    "TRITON_CACHE_DIR", "ARENO_KERNELS", "ARENO_HOME", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS",
)


# --------------------------------------------------------------------------------------------------- backend


class BackendUnavailable(RuntimeError):
    """This platform has no backend in this build (macOS arm64 would be MLX; WSL1, Windows and others: none)."""


def wsl_version(proc_version: str | None = None) -> int | None:
    """1 or 2 under WSL (from the /proc/version text), None on plain Linux."""
    if proc_version is None:
        try:
            proc_version = Path("/proc/version").read_text()
        except OSError:
            return None
    low = proc_version.lower()
    if "microsoft" not in low:
        return None
    return 2 if ("wsl2" in low or "microsoft-standard" in low) else 1


def select_backend(system: str | None = None, machine: str | None = None, proc_version: str | None = None) -> str:
    """The backend this platform selects: "cuda" on Linux (WSL2 included), else BackendUnavailable. No fallback."""
    system = system or _platform.system()
    machine = machine or _platform.machine()
    if system == "Linux":
        if wsl_version(proc_version) == 1:
            raise BackendUnavailable(
                "unsupported platform: WSL1 (Linux under Windows without a real Linux kernel); areno needs WSL2 "
                "or native Linux: convert with `wsl --set-version <distro> 2`"
            )
        return "cuda"
    if system == "Darwin" and machine.lower() in ("arm64", "aarch64"):
        raise BackendUnavailable(
            "The MLX backend is not part of this build: macOS on arm64 selects MLX, which this areno build does not "
            "include; run areno on Linux with an NVIDIA GPU (CUDA backend)"
        )
    name = {"Darwin": "macOS", "Windows": "native Windows"}.get(system, system or "unknown OS")
    raise BackendUnavailable(
        f"unsupported platform: {name} {machine}; areno runs on Linux x86_64/aarch64 (WSL2 included) "
        "with the CUDA backend"
    )


# ------------------------------------------------------------------------------------------- setup record


def areno_home() -> Path:
    """$ARENO_HOME, else $XDG_CACHE_HOME/areno, else ~/.cache/areno."""
    home = env_value("ARENO_HOME")
    if home:
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "areno"


def setup_path() -> Path:
    return areno_home() / "setup.json"


def runs_dir() -> Path:
    """The folder of the default metrics folder (runs/latest, without --metrics-dir or --save-path)."""
    return Path("runs")


def read_setup() -> dict | None:
    """The record install.sh wrote, or None when there is none. A corrupt record raises ValueError."""
    path = setup_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"setup record {path} is unreadable ({e}); rerun `bash scripts/install.sh`") from e
    if not isinstance(data, dict):
        raise ValueError(f"setup record {path} is not a JSON object; rerun `bash scripts/install.sh`")
    return data


def write_setup(record: dict) -> Path:
    """Write the record atomically (temp file in the same folder, then rename)."""
    path = setup_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".setup-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


_TORCH_ERROR = ""


def _torch_or_none():
    global _TORCH_ERROR
    try:
        import torch
    except Exception as e:
        _TORCH_ERROR = f"{type(e).__name__}: {e}"
        return None
    return torch


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:
        return None
    return triton.__version__


def gpu_list(torch=None) -> list[dict]:
    """Visible CUDA devices: index, name, memory (GiB) and compute capability ("9.0")."""
    torch = torch or _torch_or_none()
    if torch is None or not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}"})
    return gpus


def _capability(gpu: dict) -> tuple[int, int]:
    major, minor = gpu["capability"].split(".")
    return int(major), int(minor)


def detect_attn_backend() -> dict:
    """What this host supports now: flash with a CUDA GPU of capability >= 8.0 and Triton, native otherwise."""
    if "torch" not in sys.modules and not _nvidia_driver_present():
        # No NVIDIA driver: no CUDA device for sure, and importing torch (seconds) would not change the answer.
        info = {"gpu": None, "capability": None, "torch": dependency_version("torch", "torch"),
                "triton": dependency_version("triton", "triton")}
        return {"attn_backend": "native", "reason": "no CUDA device", **info}
    torch = _torch_or_none()
    info = {"gpu": None, "capability": None, "torch": torch.__version__ if torch else None, "triton": _triton_version()}
    if torch is None:
        return {"attn_backend": "native", "reason": "torch is not importable", **info}
    gpus = gpu_list(torch)
    if not gpus:
        return {"attn_backend": "native", "reason": "no CUDA device", **info}
    weakest = min(gpus, key=_capability)
    info.update(gpu=weakest["name"], capability=weakest["capability"])
    if _capability(weakest) < FLASH_MIN_CAPABILITY:
        reason = f"{weakest['name']} has compute capability {weakest['capability']} < 8.0"
        return {"attn_backend": "native", "reason": reason, **info}
    if info["triton"] is None:
        return {"attn_backend": "native", "reason": "triton is not importable", **info}
    reason = f"{weakest['name']} (capability {weakest['capability']}) with Triton {info['triton']}"
    return {"attn_backend": "flash", "reason": reason, **info}


def default_attn_backend() -> str:
    """The attention backend the runtime uses when --attn-backend is not given: the recorded one, else detected."""
    try:
        record = read_setup()
    except ValueError as e:
        print(f"warning: {e}", file=sys.stderr)
        record = None
    if record and record.get("attn_backend") in ATTN_BACKENDS:
        return record["attn_backend"]
    return detect_attn_backend()["attn_backend"]


def record_setup(kernels_built: bool = False, dry_run: bool = False) -> tuple[dict, bool]:
    """Detect the attention setup and write it unless the record already says the same. Returns (record, changed)."""
    record = {**detect_attn_backend(), "kernels_built": kernels_built, "written_by": "install.sh"}
    try:
        old = read_setup()
    except ValueError:
        old = None
    if old is not None and {k: v for k, v in old.items() if k != "time"} == record:
        return old, False
    record["time"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if not dry_run:
        write_setup(record)
    return record, True


# ------------------------------------------------------------------------------------------------- checks


@dataclass
class Check:
    status: str  # OK | WARN | FAIL
    name: str
    detail: str
    next_step: str = ""

    def line(self) -> str:
        tail = f" -> {self.next_step}" if self.status != "OK" and self.next_step else ""
        return f"{self.status:<4} {self.name}: {self.detail}{tail}"


def dependency_version(dist: str, module: str) -> str | None:
    """Installed version of a dependency (without importing it), or None when it is missing."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2])


def _nvidia_driver_present() -> bool:
    if os.path.isdir("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl"):
        return True
    return _run(["nvidia-smi", "-L"]) is not None


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def driver_version() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


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


def _check_platform() -> Check:
    system, machine = _platform.system(), _platform.machine()
    try:
        backend = select_backend()
    except BackendUnavailable as e:
        return Check("FAIL", "platform", str(e), "run areno on Linux x86_64/aarch64 with an NVIDIA GPU")
    wsl = " (WSL2)" if system == "Linux" and wsl_version() == 2 else ""
    if machine not in ("x86_64", "aarch64"):
        return Check("WARN", "platform", f"{system} {machine}: {backend.upper()} backend on an untested architecture",
                     "areno is tested on Linux x86_64 and aarch64")
    return Check("OK", "platform", f"{system} {machine}{wsl}: {backend.upper()} backend")


def _check_torch(torch, nvidia: bool) -> Check:
    if torch is None:
        step = NEXT_TORCH_CUDA if nvidia else "run `bash scripts/install.sh` (it installs the CPU build without a GPU)"
        return Check("FAIL", "torch", f"not importable ({_TORCH_ERROR})", step)
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
    version = _triton_version()
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
    torch = _torch_or_none()
    nvidia = _nvidia_driver_present()
    gpus = gpu_list(torch)
    steps = [
        _check_python, _check_platform, lambda: _check_torch(torch, nvidia), lambda: _check_gpus(torch, gpus, nvidia),
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


def run_check(argv: list[str]) -> int:
    """`areno check`: print one line per check; exit code 1 on any FAIL, else 0."""
    parser = argparse.ArgumentParser(prog="areno check", description="Readiness checks, one OK/WARN/FAIL line each.")
    parser.parse_args(argv)
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
    torch = _torch_or_none()
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
        "triton": _triton_version(),
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


def warmup(device: str = "cuda") -> dict[str, str]:
    """Run each public Triton kernel once on small tensors so that Triton compiles and caches it (in ~/.triton or
    $TRITON_CACHE_DIR); ``areno.kernels.warmup`` holds the recipes (imported here: it needs torch)."""
    from areno.kernels import warmup as kernels_warmup

    return kernels_warmup.warmup(device)


def run_warmup(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="python -m areno.platform warmup", description=warmup.__doc__).parse_args(argv)
    try:
        results = warmup()
    except RuntimeError as e:
        print(f"warmup: {e}")
        return 1
    for name, outcome in results.items():
        print(f"  {name}: {outcome}")
    return 1 if any(o.startswith("failed") for o in results.values()) else 0


def run_record_setup(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areno.platform record-setup",
        description="Detect the attention setup and record it for `areno check` and the runtime.",
    )
    parser.add_argument("--kernels-built", action="store_true", help="the Triton kernels were compiled by warmup")
    parser.add_argument("--dry-run", action="store_true", help="print what would be recorded, write nothing")
    args = parser.parse_args(argv)
    record, changed = record_setup(kernels_built=args.kernels_built, dry_run=args.dry_run)
    what = f"{record['attn_backend']} ({record['reason']})"
    if not changed:
        print(f"attention setup: {what}: unchanged in {setup_path()}")
    elif args.dry_run:
        print(f"attention setup: {what}: would record it in {setup_path()}")
    else:
        print(f"attention setup: {what}: recorded in {setup_path()}")
    return 0


def unmet_requirements(repo: Path, extras: tuple[str, ...] = ("test",)) -> list[str]:
    """What keeps the installed areno from matching the checkout `repo`: areno imported from elsewhere, no `areno`
    console script, or requirements of setup.cfg (core plus `extras`) missing or at a version out of range."""
    import configparser

    from packaging.requirements import Requirement

    import areno

    problems = []
    here = Path(areno.__file__).resolve().parent.parent
    if here != repo.resolve():
        problems.append(f"areno is imported from {here}, not {repo}")
    if not (Path(sys.prefix) / "bin" / "areno").exists():
        problems.append(f"no `areno` console script in {Path(sys.prefix) / 'bin'}")
    cfg = configparser.ConfigParser()
    cfg.read(repo / "setup.cfg")
    lines = cfg.get("options", "install_requires", fallback="").splitlines()
    for extra in extras:
        lines += cfg.get("options.extras_require", extra, fallback="").splitlines()
    for line in lines:
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req.name} is not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name} {version} does not satisfy {req.specifier}")
    return problems


def run_installed(argv: list[str]) -> int:
    """Exit 0 when areno is installed from the given checkout with every requirement met (install.sh step 5)."""
    parser = argparse.ArgumentParser(prog="python -m areno.platform installed", description=run_installed.__doc__)
    parser.add_argument("repo", type=Path, help="the checkout areno should be installed from")
    parser.add_argument("--extras", default="test", help="comma-separated extras that must be met too")
    args = parser.parse_args(argv)
    problems = unmet_requirements(args.repo, tuple(e for e in args.extras.split(",") if e))
    for problem in problems:
        print(problem)
    return 1 if problems else 0


COMMANDS = {"check": run_check, "env": run_env, "warmup": run_warmup, "record-setup": run_record_setup,
            "installed": run_installed}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m areno.platform {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
