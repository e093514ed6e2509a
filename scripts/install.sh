#!/usr/bin/env bash
# Install areno into a virtual environment and check that it is ready.
#
#   bash scripts/install.sh            install what training and serving need; a second run is a fast no-op
#   bash scripts/install.sh --test     the same plus the test extras (pytest, lm-eval, schemathesis, ruff, skypilot, ...)
#   bash scripts/install.sh --dry-run  print the plan, change nothing
#
# Steps: platform, Python, venv, torch, areno, kernels, attention setup, `areno check`.
# torch is never installed or upgraded on a host with an NVIDIA GPU: the wheel must match the driver. Without one it
# installs the CPU build: the native PyTorch path, which trains and serves the quickstart and tiny models and runs the
# tests; real model sizes need an NVIDIA GPU.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
CPU_INDEX=https://download.pytorch.org/whl/cpu
STEPS=8
DRY_RUN=0
TEST_EXTRAS=0

usage() {
  cat <<EOF
usage: bash scripts/install.sh [--test] [--dry-run] [--help]

Installs areno (editable, with what training and serving need) into the active virtual environment, or into
.venv in the repository (created when missing), then compiles the Triton kernels on a GPU, records the
attention setup and runs \`areno check\`. Running it again is a fast no-op.

  --test      also install the test extras (pytest, lm-eval, schemathesis, ruff, ...) to run the test suite
  --dry-run   print every step of the plan and change nothing
  --help      show this help

Environment: PYTHON (interpreter used to create .venv; default python3), VIRTUAL_ENV (reused when set),
ARENO_HOME (where the setup record goes; default ~/.cache/areno).
On a host with an NVIDIA GPU, install a CUDA build of torch >= 2.6 matching the driver first. Without one, the
CPU build of torch is installed: the CPU trains and serves the quickstart and tiny models and runs the tests; real
model sizes need an NVIDIA GPU.
EOF
}

for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --test) TEST_EXTRAS=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option: $arg" >&2; usage >&2; exit 2 ;;
  esac
done

# setup.cfg's extras: `train` (the reward-curve plot, TensorBoard, the math example's reward) and `serve` are what
# training and serving need; `test` (pytest, lm-eval, schemathesis, ruff, ...) only the test suite.
EXTRAS=train,serve
[ "$TEST_EXTRAS" = 1 ] && EXTRAS=$EXTRAS,test

step() { echo "[$1/$STEPS] $2"; }
say() { echo "      $*"; }
die() { echo "error: $*" >&2; exit 1; }
# act CMD...: run a command that changes something; under --dry-run only print it.
act() {
  if [ "$DRY_RUN" = 1 ]; then say "would run: $*"; else say "+ $*"; "$@"; fi
}
# Probes run from / so that the checkout on the current directory cannot stand in for an installed areno.
probe() { (cd / && "$@"); }
[ "$DRY_RUN" = 1 ] && export PYTHONDONTWRITEBYTECODE=1 && echo "dry run: nothing will be changed"

# ---------------------------------------------------------------------------------------------- 1. platform
step 1 "platform"
gpu=0
nvidia_proc=${ARENO_NVIDIA_PROC:-/proc/driver/nvidia}  # overridable so tests can fake a host without the driver
if nvidia-smi -L >/dev/null 2>&1 || [ -d "$nvidia_proc" ]; then gpu=1; fi
os_name=$(uname -s)
arch=$(uname -m)
proc_version=${ARENO_PROC_VERSION:-/proc/version}  # overridable so tests can fake WSL
case "$os_name" in
  Linux)
    case "$arch" in
      x86_64|aarch64) ;;
      *) die "unsupported platform: Linux $arch; areno supports Linux x86_64 and aarch64" ;;
    esac
    wsl=""
    if grep -qi microsoft "$proc_version" 2>/dev/null; then
      grep -qiE 'wsl2|microsoft-standard' "$proc_version" \
        || die "unsupported platform: WSL1; areno needs WSL2 or native Linux (wsl --set-version <distro> 2)"
      wsl=" (WSL2)"
    fi
    if [ "$gpu" = 1 ]; then say "Linux $arch$wsl: CUDA backend"
    else say "Linux $arch$wsl: no NVIDIA GPU: the native PyTorch path on the CPU (the CUDA backend needs an NVIDIA GPU)"
    fi ;;
  Darwin)
    [ "$arch" = arm64 ] && die "macOS arm64 selects the MLX backend: the MLX backend is not part of this build; use Linux with an NVIDIA GPU"
    die "unsupported platform: macOS $arch; areno supports Linux x86_64/aarch64 (WSL2 included)" ;;
  MINGW*|MSYS*|CYGWIN*|Windows*)
    die "unsupported platform: native Windows ($os_name); use WSL2" ;;
  *)
    die "unsupported platform: $os_name $arch; areno supports Linux x86_64/aarch64 (WSL2 included)" ;;
esac

# ------------------------------------------------------------------------------------------------ 2. Python
step 2 "Python >= 3.10"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY=$VIRTUAL_ENV/bin/python
elif [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
else PY=$(command -v python3 || true)
fi
[ -n "$PY" ] && command -v "$PY" >/dev/null || die "python3 not found: install Python >= 3.10 or set PYTHON=/path/to/python"
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; }
py_version() { "$1" -c 'import platform; print(platform.python_version())'; }
py_ok "$PY" || die "$PY is Python $(py_version "$PY" 2>/dev/null || echo '?'): areno needs Python >= 3.10 (set PYTHON=...)"
say "Python $(py_version "$PY") ($PY)"

# ------------------------------------------------------------------------------------------------- 3. venv
step 3 "virtual environment"
if [ -n "${VIRTUAL_ENV:-}" ]; then
  VENV=$VIRTUAL_ENV
  [ -x "$VENV/bin/python" ] || die "VIRTUAL_ENV=$VENV has no bin/python"
  say "reusing the active virtual environment $VENV"
  # .venv/bin/... is how the README reaches the environment: point .venv at the active one if it is free (absent,
  # or a link to an environment that no longer exists)
  if [ ! -e "$REPO/.venv" ] && [ "$(cd "$VENV" && pwd -P)" != "$(cd "$REPO" && pwd -P)/.venv" ]; then
    act ln -sfn "$VENV" "$REPO/.venv"
  fi
elif [ -x "$REPO/.venv/bin/python" ]; then
  VENV=$REPO/.venv
  say "reusing $VENV"
else
  VENV=$REPO/.venv
  act "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
if [ -x "$VPY" ]; then
  py_ok "$VPY" || die "$VPY is Python $(py_version "$VPY"): areno needs >= 3.10; remove $VENV or use another venv"
  RUNPY=$VPY
else
  RUNPY=$PY  # dry run before the venv exists: read-only probes use the base interpreter
fi

# ------------------------------------------------------------------------------------------------ 4. torch
step 4 "PyTorch"
# What the CPU path is for, said the same way wherever the installer mentions it.
cpu_path="the CPU runs the native PyTorch path: the tests, and training and serving the quickstart and tiny models; real model sizes need an NVIDIA GPU"
# torch's version and CUDA build, read from torch/version.py without importing torch (that takes seconds).
torch_info() {
  probe "$VPY" -c 'import importlib.util, os, runpy
v = runpy.run_path(os.path.join(importlib.util.find_spec("torch").submodule_search_locations[0], "version.py"))
print(v["__version__"], v["cuda"] or "none")' 2>/dev/null
}
torch_version=""
torch_cuda=""
if [ -x "$VPY" ] && info=$(torch_info); then
  torch_version=${info% *}
  torch_cuda=${info#* }
fi
# cuda_tag X.Y: the newest PyTorch CUDA wheel tag a driver supporting CUDA X.Y can run.
cuda_tag() {
  local major=${1%%.*} minor=${1#*.} t
  for t in 1300:cu130 1209:cu129 1208:cu128 1206:cu126 1204:cu124 1201:cu121 1108:cu118; do
    if [ $((major * 100 + minor)) -ge "${t%%:*}" ]; then echo "${t#*:}"; return 0; fi
  done
  return 1
}
if [ "$gpu" = 1 ]; then
  if [ -n "$torch_version" ]; then
    say "NVIDIA GPU found: keeping torch $torch_version (CUDA $torch_cuda); areno never installs or upgrades torch on a GPU host"
    [ "$torch_cuda" = none ] && say "warning: this torch is a CPU build; install a CUDA build matching the driver"
  else
    driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n1)
    if [ -n "$driver_cuda" ] && tag=$(cuda_tag "$driver_cuda"); then
      fix="$VPY -m pip install torch --index-url https://download.pytorch.org/whl/$tag"
      why="the driver supports CUDA $driver_cuda"
    else
      fix="$VPY -m pip install torch --index-url https://download.pytorch.org/whl/cuXYZ  (XYZ: the CUDA version nvidia-smi shows, 118 or newer)"
      why="could not read a supported CUDA version from nvidia-smi${driver_cuda:+ ($driver_cuda)}"
    fi
    msg="torch is not installed in $VENV, and areno does not install torch on a GPU host ($why). Install it, then rerun:"
    if [ "$DRY_RUN" = 1 ]; then say "$msg"; say "  $fix"; say "(a real run stops here)"
    else echo "error: $msg" >&2; echo "  $fix" >&2; exit 1
    fi
  fi
elif [ -n "$torch_version" ]; then
  say "no NVIDIA GPU: keeping torch $torch_version ($cpu_path)"
else
  say "no NVIDIA GPU: installing the CPU build of torch ($cpu_path)"
  # Where the CPU wheel comes from: PyTorch's CPU index when it is reachable; otherwise a CPU wheel pip already
  # sees locally (pip's find-links, e.g. a wheel folder named in pip.conf). Never a plain `pip install torch` from
  # PyPI: on Linux that is the multi-GB CUDA build.
  if command -v curl >/dev/null && curl -sI --max-time 5 -o /dev/null "$CPU_INDEX/"; then
    act "$VPY" -m pip install --index-url "$CPU_INDEX" torch
  else
    local_cpu=$(probe "$RUNPY" -m pip install --dry-run --ignore-installed --no-index --no-deps torch 2>/dev/null \
                | sed -n 's/^Would install torch-\([^ ]*+cpu\)$/\1/p' || true)
    [ -n "$local_cpu" ] || die "$CPU_INDEX is unreachable and pip sees no local torch CPU wheel; install torch yourself: pip install torch --index-url $CPU_INDEX"
    say "$CPU_INDEX is unreachable: using the local CPU wheel torch $local_cpu"
    act "$VPY" -m pip install "torch==$local_cpu"
  fi
fi

# ------------------------------------------------------------------------------------------------ 5. areno
step 5 "areno (editable, extras $EXTRAS)"
stamp_file=$VENV/.areno-install-stamp
stamp=$(cat "$REPO/setup.cfg" "$REPO/pyproject.toml" <(echo "$REPO $EXTRAS") | sha256sum | cut -d' ' -f1)
installed_from=""
if [ -x "$VPY" ]; then
  installed_from=$(probe "$VPY" -c 'import areno, os; print(os.path.dirname(os.path.dirname(os.path.realpath(areno.__file__))))' 2>/dev/null || true)
fi
if [ "$(cat "$stamp_file" 2>/dev/null || true)" = "$stamp" ] && [ "$installed_from" = "$REPO" ]; then
  say "already installed from $REPO and up to date: nothing to do"
elif [ -n "$installed_from" ] && probe "$VPY" -m areno.platform installed "$REPO" --extras "$EXTRAS" >/dev/null 2>&1; then
  # Installed from this checkout by other means, every requirement met: no pip (which may need the network).
  say "already installed from $REPO with every requirement of setup.cfg (extras $EXTRAS) met: nothing to do"
  if [ "$DRY_RUN" = 1 ]; then say "would write $stamp_file"; else echo "$stamp" > "$stamp_file"; fi
else
  pip_args=(install --upgrade-strategy only-if-needed)
  # Pin the torch that is there, so no dependency can upgrade it; without a GPU, also the Triton release that torch
  # was built with (a CPU torch wheel does not name one, and the newest Triton may not match its interpreter).
  [ -z "$torch_version" ] && [ "$DRY_RUN" != 1 ] && torch_version=$(probe "$VPY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
  pins=""
  [ -n "$torch_version" ] && pins="torch==$torch_version"
  if [ "$gpu" != 1 ] && ! probe "$VPY" -c 'import triton' >/dev/null 2>&1; then
    case $torch_version in
      2.13.*) pins="$pins triton==3.7.1" ;;
      2.11.*) pins="$pins triton==3.6.0" ;;
    esac
  fi
  if [ -n "$pins" ] && [ "$DRY_RUN" = 1 ]; then
    pip_args+=(--constraint "<(printf '%s\\n' $pins)")
  elif [ -n "$pins" ]; then
    pin=$(mktemp "${TMPDIR:-/tmp}/areno-torch-pin.XXXXXX")
    trap 'rm -f "$pin"' EXIT
    printf '%s\n' $pins > "$pin"
    pip_args+=(--constraint "$pin")
  fi
  # Build with the venv's own setuptools when it can build editables: faster, and works offline.
  if [ -x "$VPY" ] && probe "$VPY" -c 'import importlib.util as u, setuptools as s, sys
v = tuple(int(x) for x in s.__version__.split(".")[:2])
sys.exit(not (v >= (70, 1) or (v >= (64, 0) and u.find_spec("wheel"))))' 2>/dev/null; then
    pip_args+=(--no-build-isolation)
  fi
  act "$VPY" -m pip "${pip_args[@]}" -e "$REPO[$EXTRAS]"
  # tests/serve/test_client_instructor.py's client, without its dependencies: instructor pins jiter<0.15, which
  # rules out the openai >= 3.4 that inspect-ai needs; it runs on the newer jiter (setup.cfg's test extra lists what
  # else it imports)
  [ "$TEST_EXTRAS" = 1 ] && act "$VPY" -m pip install -q --no-deps "instructor>=1.17"
  # tests/distributed/test_templates.py's SkyPilot task loader, without its dependencies: they would downgrade
  # uvicorn (<0.36) and click (<8.2) and add its API server's; setup.cfg's test extra lists the ones it imports
  [ "$TEST_EXTRAS" = 1 ] && act "$VPY" -m pip install -q --no-deps "skypilot>=0.14.1,<0.15"
  if [ "$DRY_RUN" = 1 ]; then say "would write $stamp_file"; else echo "$stamp" > "$stamp_file"; fi
fi

# ---------------------------------------------------------------------------------------------- 6. kernels
step 6 "kernels"
kernels_built=0
if [ "$gpu" = 1 ] && [ -n "$torch_cuda" ] && [ "$torch_cuda" != none ]; then
  kstamp_file=$VENV/.areno-kernels-stamp
  triton_version=$(probe "$VPY" -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)
  kstamp=$(cat "$REPO"/areno/kernels/*.py <(echo "$torch_version $triton_version") <(nvidia-smi -L 2>/dev/null) \
           | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$kstamp_file" 2>/dev/null || true)" = "$kstamp" ]; then
    say "Triton kernels already compiled and cached for this GPU, torch $torch_version and triton $triton_version"
    kernels_built=1
  elif [ "$DRY_RUN" = 1 ]; then
    say "would run: $VPY -m areno.platform warmup  (compiles and caches the Triton kernels in ${TRITON_CACHE_DIR:-~/.triton})"
  elif (cd "$REPO" && "$VPY" -m areno.platform warmup); then
    echo "$kstamp" > "$kstamp_file"
    kernels_built=1
  else
    say "warning: the kernel warm-up failed (see above); kernels compile on first use instead"
  fi
elif [ "$gpu" = 1 ]; then
  say "skipped: needs a CUDA build of torch (see step 4)"
else
  say "no GPU: nothing to build (Triton kernels run on the GPU; the CPU path uses native PyTorch)"
fi

# -------------------------------------------------------------------------------------- 7. attention setup
step 7 "attention setup (flash on GPUs with capability >= 8.0 and Triton, native otherwise)"
record_args=""
[ "$kernels_built" = 1 ] && record_args=--kernels-built
if [ "$DRY_RUN" = 1 ]; then
  (cd "$REPO" && "$RUNPY" -m areno.platform record-setup --dry-run $record_args | sed 's/^/      /') \
    || say "would record the attention setup once torch and areno are installed"
else
  (cd "$REPO" && "$VPY" -m areno.platform record-setup $record_args) | sed 's/^/      /'
fi

# ------------------------------------------------------------------------------------------------- 8. check
step 8 "areno check  (activate the environment with: source $VENV/bin/activate)"
if [ "$DRY_RUN" = 1 ]; then
  say "would run: $VENV/bin/areno check"
  exit 0
fi
if [ -x "$VENV/bin/areno" ] && [ -f "$REPO/areno/cli.py" ]; then
  exec "$VENV/bin/areno" check
fi
exec "$VPY" -m areno.platform check
