"""scripts/install.sh: dry run changes nothing, the real run ends with `areno check`, a second run is a no-op, and
the platform and GPU rules (MLX message, explicit errors, never installing torch on a GPU host)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install.sh"
# One worker for the whole file under `pytest -n 2 --dist loadgroup`: a real install (second_run_is_a_no_op) writes
# the venv's install stamp, which the dry run's before/after snapshot must not see change under it (the group's name
# is the one conftest gives the tests here that share a module fixture).
pytestmark = pytest.mark.xdist_group("tests/test_install.py")
CHECK_LINE = re.compile(r"^(OK  |WARN|FAIL) [a-z ]+: ")
# Other engineers edit source files while these tests run; install.sh writes none (only .venv, areno.egg-info, the
# setup record and pip's packages), so changes to source files are left out of the dry-run comparison.
SOURCE_DIRS = ("areno", "tests", "bench", "examples", "docs")
SOURCE_SUFFIXES = {".py", ".md", ".txt", ".json", ".jsonl", ".toml", ".cfg", ".yaml", ".yml", ".sh", ".ini", ".csv"}
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".venv"}


def others_edit(rel: str) -> bool:
    if rel.startswith("areno.egg-info"):
        return False
    return rel.split("/")[0] in SOURCE_DIRS or Path(rel).suffix in SOURCE_SUFFIXES


def venv_env(**extra) -> tuple[dict, Path]:
    """The environment to run install.sh against the real venv (the one running these tests), and that venv."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    venv = REPO / ".venv"
    if sys.prefix != sys.base_prefix and Path(sys.prefix).resolve() != venv.resolve():
        venv = Path(sys.prefix)
        env["VIRTUAL_ENV"] = str(venv)
    env.update(extra)
    return env, venv


def install(*args, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)


def snapshot(venv: Path) -> dict:
    """What install.sh could change: files and folders of the repo, git status, the venv and its packages."""
    files, folders = {}, set()
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        rel_root = Path(root).relative_to(REPO)
        if not others_edit(str(rel_root / "x")):
            folders.add(str(rel_root))
        for name in names:
            rel = str(rel_root / name)
            if not others_edit(rel):
                st = os.lstat(os.path.join(root, name))
                files[rel] = (st.st_mtime_ns, st.st_size)
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                            capture_output=True, text=True).stdout.splitlines()
    site = next((venv / "lib").glob("python3*/site-packages"))
    freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True)
    return {
        "files": files,
        "folders": folders,
        "git": sorted(line for line in status if not others_edit(line[3:])),
        "venv": sorted(os.listdir(venv)) + sorted(os.listdir(venv / "bin")),
        "venv_mtimes": {p.name: p.stat().st_mtime_ns for p in venv.iterdir()},
        "site_packages": sorted(os.listdir(site)),
        "pip_freeze": freeze.stdout,
    }


def shim(folder: Path, name: str, body: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n" + body)
    (folder / name).chmod(0o755)


def test_dry_run_changes_nothing(tmp_path):
    home = tmp_path / "home"
    proc_version = tmp_path / "version"  # a WSL2 kernel string: WSL2 follows the Linux path
    proc_version.write_text("Linux version 5.15.153.1-microsoft-standard-WSL2 (root@1c602f52c2e4)\n")
    env, venv = venv_env(ARENO_HOME=str(home), ARENO_PROC_VERSION=str(proc_version))
    before = snapshot(venv)
    out = install("--dry-run", env=env)
    after = snapshot(venv)
    assert out.returncode == 0, out.stdout + out.stderr
    for key in before:
        assert before[key] == after[key], f"--dry-run changed {key}"
    assert not home.exists()  # no setup record either
    for n in range(1, 9):
        assert f"[{n}/8] " in out.stdout
    assert "Linux x86_64 (WSL2): " in out.stdout or "Linux aarch64 (WSL2): " in out.stdout
    assert "would record it in" in out.stdout or "unchanged in" in out.stdout
    assert out.stdout.rstrip().endswith("check")  # the last step is planned, not run


def test_install_then_second_run_is_a_no_op(tmp_path):
    home = tmp_path / "home"
    env, venv = venv_env(ARENO_HOME=str(home))
    first = install(env=env)  # in CI install.sh ran just before the tests, so this is already a no-op there
    assert first.returncode == 0, first.stdout + first.stderr
    lines = first.stdout.rstrip().splitlines()
    check_start = max(i for i, line in enumerate(lines) if line.startswith("[8/8] ")) + 1
    check = lines[check_start:]
    assert len(check) >= 10 and all(CHECK_LINE.match(line) for line in check), check
    assert not any(line.startswith("FAIL") for line in check)
    record = json.loads((home / "setup.json").read_text())
    assert record["written_by"] == "install.sh" and record["attn_backend"] in ("flash", "native")
    import torch

    if not torch.cuda.is_available():
        assert check[3] == ("WARN gpu: no CUDA device: the native PyTorch path runs on the CPU (tests, the quickstart "
                            "and tiny models) -> for real model sizes, use a Linux host with an NVIDIA GPU")
        assert "no GPU: nothing to build" in first.stdout and record["attn_backend"] == "native"

    stamp = venv / ".areno-install-stamp"
    before = (stamp.stat().st_mtime_ns, (home / "setup.json").stat().st_mtime_ns, sorted(os.listdir(venv)))
    t0 = time.monotonic()
    second = install(env=env)
    elapsed = time.monotonic() - t0
    assert second.returncode == 0, second.stdout + second.stderr
    assert elapsed < 30, f"second run took {elapsed:.1f} s"
    assert "already installed from" in second.stdout and "nothing to do" in second.stdout
    assert "pip install" not in second.stdout and "unchanged in" in second.stdout
    assert before == (stamp.stat().st_mtime_ns, (home / "setup.json").stat().st_mtime_ns, sorted(os.listdir(venv)))
    assert second.stdout.splitlines()[-len(check):][0].startswith("OK   python:")


@pytest.mark.parametrize(
    "system, machine, message",
    [
        ("Darwin", "arm64", "the MLX backend is not part of this build"),
        ("Darwin", "x86_64", "unsupported platform: macOS x86_64"),
        ("FreeBSD", "amd64", "unsupported platform: FreeBSD amd64"),
        ("Linux", "ppc64le", "unsupported platform: Linux ppc64le"),
        ("MINGW64_NT-10.0", "x86_64", "native Windows"),
    ],
)
def test_unsupported_platforms_stop_at_step_one(tmp_path, system, machine, message):
    shim(tmp_path / "bin", "uname", f'case "$1" in -m) echo {machine};; *) echo {system};; esac\n')
    env, _ = venv_env(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    out = install("--dry-run", env=env, timeout=60)
    assert out.returncode == 1
    assert message in out.stderr and "[2/8]" not in out.stdout


def test_wsl1_is_refused(tmp_path):
    (tmp_path / "version").write_text("Linux version 4.4.0-19041-Microsoft (Microsoft@Microsoft.com) (gcc 5.4.0)\n")
    env, _ = venv_env(ARENO_PROC_VERSION=str(tmp_path / "version"))
    out = install("--dry-run", env=env, timeout=60)
    assert out.returncode == 1 and "WSL1" in out.stderr and "[2/8]" not in out.stdout


@pytest.fixture(scope="module")
def torchless_venv(tmp_path_factory):
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv


@pytest.mark.parametrize("driver_cuda, tag", [("12.8", "cu128"), ("12.5", "cu124"), ("13.2", "cu130"),
                                              ("11.8", "cu118")])
def test_gpu_host_without_torch_stops_with_the_matching_wheel(tmp_path, torchless_venv, driver_cuda, tag):
    shim(tmp_path / "bin", "nvidia-smi", f"""[ "$1" = -L ] && {{ echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0; }}
echo "| NVIDIA-SMI 570.86.15    Driver Version: 570.86.15    CUDA Version: {driver_cuda}     |"
""")
    env, _ = venv_env(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", VIRTUAL_ENV=str(torchless_venv))
    before = sorted(str(p.relative_to(torchless_venv)) for p in torchless_venv.rglob("*"))
    out = install(env=env, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "areno does not install torch on a GPU host" in out.stderr
    assert f"pip install torch --index-url https://download.pytorch.org/whl/{tag}" in out.stderr
    assert "[5/8]" not in out.stdout
    assert sorted(str(p.relative_to(torchless_venv)) for p in torchless_venv.rglob("*")) == before


CPU_PATH = ("the CPU runs the native PyTorch path: the tests, and training and serving the quickstart and tiny models; "
            "real model sizes need an NVIDIA GPU")


def test_cpu_host_without_torch_plans_the_cpu_build_and_says_what_a_cpu_is_for(tmp_path, torchless_venv):
    """The README promises that a CPU machine trains the quickstart: the installer says so too, never "training
    needs a GPU"."""
    bin_dir = tmp_path / "bin"
    shim(bin_dir, "nvidia-smi", "exit 1\n")  # no GPU, even where the test runs on a GPU host
    shim(bin_dir, "curl", "exit 0\n")  # PyTorch's CPU index "reachable": nothing is fetched under --dry-run
    env, _ = venv_env(PATH=f"{bin_dir}:{os.environ['PATH']}", VIRTUAL_ENV=str(torchless_venv),
                      ARENO_NVIDIA_PROC=str(tmp_path / "no-driver"), ARENO_HOME=str(tmp_path / "home"))
    out = install("--dry-run", env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"no NVIDIA GPU: installing the CPU build of torch ({CPU_PATH})" in out.stdout
    assert "pip install --index-url https://download.pytorch.org/whl/cpu torch" in out.stdout
    assert "needs a GPU" not in out.stdout + out.stderr
    assert not (tmp_path / "home").exists()


def test_cpu_host_with_torch_says_what_a_cpu_is_for(tmp_path):
    bin_dir = tmp_path / "bin"
    shim(bin_dir, "nvidia-smi", "exit 1\n")
    env, _ = venv_env(PATH=f"{bin_dir}:{os.environ['PATH']}", ARENO_NVIDIA_PROC=str(tmp_path / "no-driver"),
                      ARENO_HOME=str(tmp_path / "home"))
    out = install("--dry-run", env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(rf"no NVIDIA GPU: keeping torch \S+ \({re.escape(CPU_PATH)}\)", out.stdout), out.stdout


def test_help():
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--dry-run" in out.stdout and "[1/8]" not in out.stdout
    assert "the CPU trains and serves the quickstart and tiny models" in " ".join(out.stdout.split())
    out = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown option: --bogus" in out.stderr


@pytest.mark.parametrize("flags, extras", [((), "train,serve"), (("--test",), "train,serve,test")])
def test_main_install_leaves_out_the_test_extras(tmp_path, torchless_venv, flags, extras):
    """The README's first command installs what training and serving need; only `--test` (its second command) adds
    the test extras (lm-eval, schemathesis, ruff, ...)."""
    bin_dir = tmp_path / "bin"
    shim(bin_dir, "nvidia-smi", "exit 1\n")
    shim(bin_dir, "curl", "exit 0\n")
    env, _ = venv_env(PATH=f"{bin_dir}:{os.environ['PATH']}", VIRTUAL_ENV=str(torchless_venv),
                      ARENO_NVIDIA_PROC=str(tmp_path / "no-driver"), ARENO_HOME=str(tmp_path / "home"))
    out = install("--dry-run", *flags, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"[5/8] areno (editable, extras {extras})" in out.stdout
    plan = [line for line in out.stdout.splitlines() if "would run:" in line and " -e " in line]
    assert len(plan) == 1 and plan[0].endswith(f" -e {REPO}[{extras}]"), plan
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    main = {r.split("#")[0].split(">")[0].split("<")[0].split("=")[0].strip() for extra in ("train", "serve")
            for r in cfg.get("options.extras_require", extra).splitlines()} - {""}
    assert {"matplotlib", "tensorboard", "fastapi", "uvicorn"} <= main
    assert not main & {"pytest", "lm-eval", "schemathesis", "ruff", "hypothesis"}


@pytest.mark.parametrize("gpu", [False, True])
def test_platform_step_names_the_cuda_backend_only_with_a_gpu(tmp_path, gpu):
    bin_dir = tmp_path / "bin"
    shim(bin_dir, "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n' if gpu else "exit 1\n")
    env, _ = venv_env(PATH=f"{bin_dir}:{os.environ['PATH']}", ARENO_NVIDIA_PROC=str(tmp_path / "no-driver"),
                      ARENO_HOME=str(tmp_path / "home"))
    out = install("--dry-run", env=env, timeout=120)
    step1 = out.stdout.split("[1/8] platform\n")[1].split("[2/8]")[0].strip()
    arch = os.uname().machine
    if gpu:
        assert step1 == f"Linux {arch}: CUDA backend", out.stdout
    else:
        assert step1 == (f"Linux {arch}: no NVIDIA GPU: the native PyTorch path on the CPU (the CUDA backend "
                         "needs an NVIDIA GPU)"), out.stdout
