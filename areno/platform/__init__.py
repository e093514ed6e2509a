"""Platform: backend selection, the attention-setup record and the host probes they need (the bottom layer: the
standard library only at the top, so the installer can run it before torch exists; torch and triton are imported
inside functions). `areno check` / `areno env` live in ``areno.platform.checks``, the installer's commands
(``python -m areno.platform check|env|warmup|record-setup|installed``) in ``areno.platform.commands``.
"""

import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform as _platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from areno.config.constants import ATTN_BACKENDS  # areno.config imports the standard library only, as this module
from areno.config.env import env_value

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


def torch_import_error() -> str:
    """Why ``import torch`` failed at the last `torch_or_none` call ("" when it did not)."""
    return _TORCH_ERROR


def torch_or_none():
    global _TORCH_ERROR
    try:
        import torch
    except Exception as e:
        _TORCH_ERROR = f"{type(e).__name__}: {e}"
        return None
    return torch


def triton_version() -> str | None:
    try:
        import triton
    except Exception:
        return None
    return triton.__version__


def gpu_list(torch=None) -> list[dict]:
    """Visible CUDA devices: index, name, memory (GiB) and compute capability ("9.0")."""
    torch = torch or torch_or_none()
    if torch is None or not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}"})
    return gpus


def gpu_capability(gpu: dict) -> tuple[int, int]:
    major, minor = gpu["capability"].split(".")
    return int(major), int(minor)


def detect_attn_backend() -> dict:
    """What this host supports now: flash with a CUDA GPU of capability >= 8.0 and Triton, native otherwise."""
    if "torch" not in sys.modules and not nvidia_driver_present():
        # No NVIDIA driver: no CUDA device for sure, and importing torch (seconds) would not change the answer.
        info = {"gpu": None, "capability": None, "torch": dependency_version("torch", "torch"),
                "triton": dependency_version("triton", "triton")}
        return {"attn_backend": "native", "reason": "no CUDA device", **info}
    torch = torch_or_none()
    info = {"gpu": None, "capability": None, "torch": torch.__version__ if torch else None, "triton": triton_version()}
    if torch is None:
        return {"attn_backend": "native", "reason": "torch is not importable", **info}
    gpus = gpu_list(torch)
    if not gpus:
        return {"attn_backend": "native", "reason": "no CUDA device", **info}
    weakest = min(gpus, key=gpu_capability)
    info.update(gpu=weakest["name"], capability=weakest["capability"])
    if gpu_capability(weakest) < FLASH_MIN_CAPABILITY:
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


def nvidia_driver_present() -> bool:
    if os.path.isdir("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl"):
        return True
    return run_command(["nvidia-smi", "-L"]) is not None


def run_command(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def driver_version() -> str | None:
    out = run_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


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
