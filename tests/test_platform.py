"""areno.platform: backend selection, the setup record, `areno check` and `areno env` on this host."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areno import platform as P
from areno.kernels.warmup import WARMUP
from areno.platform import checks as C
from areno.platform import commands as M

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^(OK  |WARN|FAIL) ([a-z ]+): (.+)$")
CHECK_NAMES = ["python", "platform", "torch", "gpu", "triton", "attention", "dependencies", "serve extra",
               "math extra", "cache", "logs"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private ARENO_HOME and working folder, so checks never touch the user's cache or ./runs."""
    monkeypatch.setenv("ARENO_HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return tmp_path / "home"


def parse(out: str) -> dict[str, tuple[str, str]]:
    lines = out.strip().splitlines()
    parsed = {}
    for line in lines:
        m = LINE.match(line)
        assert m, f"not an OK/WARN/FAIL line: {line!r}"
        status, name, detail = m.groups()
        if status != "OK  ":
            assert " -> " in detail, f"a {status} line must give a next step: {line!r}"
        parsed[name] = (status.strip(), detail)
    return parsed


# ------------------------------------------------------------------------------------------------ backend


def test_select_backend_by_platform():
    assert P.select_backend("Linux", "x86_64", "Linux version 6.8.0-45-generic (buildd@lcy02)") == "cuda"
    assert P.select_backend("Linux", "aarch64", "Linux version 5.15.153.1-microsoft-standard-WSL2") == "cuda"
    with pytest.raises(P.BackendUnavailable, match="WSL1"):
        P.select_backend("Linux", "x86_64", "Linux version 4.4.0-19041-Microsoft (Microsoft@Microsoft.com)")
    with pytest.raises(P.BackendUnavailable, match="The MLX backend is not part of this build"):
        P.select_backend("Darwin", "arm64")
    with pytest.raises(P.BackendUnavailable, match="unsupported platform: macOS x86_64"):
        P.select_backend("Darwin", "x86_64")
    with pytest.raises(P.BackendUnavailable, match="unsupported platform: native Windows AMD64"):
        P.select_backend("Windows", "AMD64")
    with pytest.raises(P.BackendUnavailable, match="unsupported platform: FreeBSD amd64"):
        P.select_backend("FreeBSD", "amd64")
    assert P.wsl_version("Linux version 6.8.0-45-generic") is None
    assert P.select_backend() == "cuda"  # this host is Linux


# ------------------------------------------------------------------------------------------- setup record


def test_setup_record_round_trip(home, monkeypatch, tmp_path):
    assert P.setup_path() == home / "setup.json"
    assert P.read_setup() is None
    record = {"attn_backend": "flash", "reason": "test", "gpu": "NVIDIA H200", "capability": "9.0",
              "torch": "2.11.0", "triton": "3.6.0", "kernels_built": True, "written_by": "install.sh",
              "time": "2026-01-01T00:00:00+00:00"}
    assert P.write_setup(record) == home / "setup.json"
    assert P.read_setup() == record
    assert sorted(p.name for p in home.iterdir()) == ["setup.json"]  # the atomic write left no temp file
    assert P.default_attn_backend() == "flash"  # the record wins over detection
    P.write_setup({**record, "attn_backend": "native"})
    assert P.default_attn_backend() == "native"

    (home / "setup.json").write_text("{not json")
    with pytest.raises(ValueError, match="install.sh"):
        P.read_setup()
    expected = "flash" if P.detect_attn_backend()["attn_backend"] == "flash" else "native"
    assert P.default_attn_backend() == expected  # corrupt record: detection, with a warning on stderr

    monkeypatch.delenv("ARENO_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert P.setup_path() == tmp_path / "xdg" / "areno" / "setup.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert P.areno_home() == Path.home() / ".cache" / "areno"


def test_record_setup_writes_only_on_change(home):
    record, changed = P.record_setup(dry_run=True)
    assert changed and not (home / "setup.json").exists()
    record, changed = P.record_setup()
    assert changed and P.read_setup() == record
    assert record["written_by"] == "install.sh" and record["kernels_built"] is False
    assert record["torch"] == torch.__version__
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        assert record["gpu"] in names and record["attn_backend"] in P.ATTN_BACKENDS
    else:
        assert record["attn_backend"] == "native" and record["reason"] == "no CUDA device"
    mtime = (home / "setup.json").stat().st_mtime_ns
    again, changed = P.record_setup()
    assert not changed and again == record and (home / "setup.json").stat().st_mtime_ns == mtime
    built, changed = P.record_setup(kernels_built=True)
    assert changed and P.read_setup()["kernels_built"] is True


# ------------------------------------------------------------------------------------------------- check


def test_check_on_this_host(home, capsys):
    assert C.run_check([]) == 0
    checks = parse(capsys.readouterr().out)
    assert list(checks) == CHECK_NAMES
    assert checks["python"][0] == "OK" and sys.executable in checks["python"][1]
    assert checks["platform"][0] == "OK" and checks["platform"][1].startswith(f"Linux {os.uname().machine}")
    assert checks["torch"][0] == "OK" and torch.__version__ in checks["torch"][1]
    if torch.cuda.is_available():
        assert checks["gpu"][0] == "OK" and torch.cuda.get_device_name(0) in checks["gpu"][1]
        assert "ran a test kernel on cuda:0" in checks["triton"][1]
    else:
        status, detail = checks["gpu"]
        assert status == "WARN" and detail.startswith(P.CPU_WARNING)
        # conftest sets TRITON_INTERPRET=1 on CPU, so the check runs its probe kernel in the interpreter
        assert checks["triton"] == ("OK", f"{P.triton_version()}: no CUDA device; a test kernel ran in the "
                                          "interpreter (TRITON_INTERPRET=1)")
    assert checks["attention"][0] == "WARN" and "no setup record" in checks["attention"][1]
    assert checks["dependencies"][0] == "OK"
    assert f"transformers {importlib.metadata.version('transformers')}" in checks["dependencies"][1]
    assert checks["cache"] == ("OK", f"{home} will be created (under writable {home.parent})")
    assert checks["logs"][0] == "OK" and checks["logs"][1].startswith(os.path.abspath("runs"))
    # the folder checks cleaned up after themselves and created nothing
    assert not home.exists() and os.listdir(".") == [] and sorted(os.listdir(home.parent)) == ["work"]


def test_check_says_what_a_cpu_host_is_for():
    """No CUDA device: a warning (never silent) that says the truth: the CPU runs the tests and trains and serves the
    quickstart and tiny models; a GPU is for real model sizes (not "train and serve on a GPU host")."""
    gpu = C._check_gpus(torch, [], nvidia=False)
    assert (gpu.status, gpu.name) == ("WARN", "gpu")
    assert gpu.detail == ("no CUDA device: the native PyTorch path runs on the CPU (tests, the quickstart and tiny "
                          "models)")
    assert gpu.next_step == "for real model sizes, use a Linux host with an NVIDIA GPU"
    cpu_torch = type("FakeTorch", (), {"__version__": "2.9.0+cpu", "version": type("V", (), {"cuda": None})})
    assert C._check_torch(cpu_torch, nvidia=False).detail == (
        "2.9.0+cpu (CPU build: the native path for tests, the quickstart and tiny models)")


def test_platform_line_names_the_cuda_backend_only_with_a_gpu(monkeypatch):
    """A host without a CUDA device runs the native PyTorch path: its platform line must not read "CUDA backend"."""
    monkeypatch.setattr(C._platform, "system", lambda: "Linux")
    monkeypatch.setattr(C._platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(C, "wsl_version", lambda: None)
    cpu = C._check_platform([])
    assert cpu.status == "OK" and cpu.detail == (
        "Linux x86_64: CPU, the native PyTorch path (the CUDA backend needs an NVIDIA GPU)")
    gpu = C._check_platform([{"index": 0, "name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139}])
    assert gpu.status == "OK" and gpu.detail == "Linux x86_64: CUDA backend"


def test_check_reads_the_record(home, capsys):
    P.record_setup()
    assert C.run_check([]) == 0
    assert parse(capsys.readouterr().out)["attention"][0] == "OK"
    P.write_setup({**P.read_setup(), "attn_backend": "flash"})
    if not torch.cuda.is_available():
        assert C.run_check([]) == 0
        status, detail = parse(capsys.readouterr().out)["attention"]
        assert status == "WARN" and "recorded in" in detail and "--attn-backend native" in detail


def test_check_fails_on_missing_core_dependency(home, capsys, monkeypatch):
    monkeypatch.setitem(P.CORE_DEPS, "areno-no-such-dep", "areno_no_such_dep")
    assert C.run_check([]) == 1
    status, detail = parse(capsys.readouterr().out)["dependencies"]
    assert status == "FAIL" and detail.startswith("missing areno-no-such-dep ->")


def test_check_warns_on_missing_extra(home, capsys, monkeypatch):
    monkeypatch.setitem(P.OPTIONAL_DEPS, "serve", ({"areno-no-server": "areno_no_server"}, "serving cannot start"))
    assert C.run_check([]) == 0
    status, detail = parse(capsys.readouterr().out)["serve extra"]
    assert status == "WARN" and detail.endswith("-> pip install 'areno[serve]'")


def test_check_fails_on_unwritable_cache(home, capsys, monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("ARENO_HOME", str(tmp_path / "a-file" / "areno"))
    assert C.run_check([]) == 1
    status, detail = parse(capsys.readouterr().out)["cache"]
    assert status == "FAIL" and "not a folder" in detail and detail.endswith("-> set ARENO_HOME to a writable folder")


def test_warmup_runs_every_kernel_recipe():
    """On a GPU: the install-time warm-up compiles every kernel. On CPU: the same recipes run in the interpreter
    (conftest sets TRITON_INTERPRET=1), which keeps them in step with the kernels' signatures."""
    if torch.cuda.is_available():
        results = M.warmup()
    else:
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            M.warmup()
        assert M.run_warmup([]) == 1
        before = os.environ.get("ARENO_KERNELS")
        results = M.warmup("cpu")
        assert os.environ.get("ARENO_KERNELS") == before
    assert list(results) == list(WARMUP)
    assert all(r.startswith("ok (") for r in results.values()), results


# --------------------------------------------------------------------------------------------------- env


def test_env_report_json(home, capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    P.record_setup()
    assert C.run_env(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("areno", "python", "platform", "torch", "cuda_available", "driver", "triton", "transformers",
                "safetensors", "accelerate", "datasets", "gpus", "dependencies", "env", "setup"):
        assert key in report, key
    import areno

    assert report["areno"]["version"] == areno.__version__
    assert report["python"] == {"version": sys.version.split()[0], "executable": sys.executable}
    assert set(report["platform"]) >= {"system", "release", "machine", "wsl"}
    assert report["torch"]["version"] == torch.__version__ and report["torch"]["cuda"] == torch.version.cuda
    assert "cudnn" in report["torch"]
    assert report["cuda_available"] == torch.cuda.is_available()
    assert len(report["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for gpu in report["gpus"]:
        assert set(gpu) == {"index", "name", "memory_gib", "capability"}
    for dep in ("transformers", "safetensors", "accelerate", "datasets"):
        assert report[dep] == importlib.metadata.version(dep)
    assert report["triton"] == importlib.metadata.version("triton")
    assert set(report["dependencies"]) == {"core", "serve", "math"}
    assert report["dependencies"]["core"]["argparse-dataclass"] == importlib.metadata.version("argparse-dataclass")
    assert report["env"]["CUDA_VISIBLE_DEVICES"] == "0,1" and report["env"]["NCCL_DEBUG"] == "INFO"
    assert report["env"]["ARENO_HOME"] == str(home) and "HF_HOME" in report["env"]
    assert report["setup"] == P.read_setup()

    assert C.run_env([]) == 0
    text = capsys.readouterr().out
    assert f"  version: {torch.__version__}" in text and "NCCL_DEBUG: INFO" in text


def test_command_line(home):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "areno", "check"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert list(parse(out.stdout)) == CHECK_NAMES
    out = subprocess.run([sys.executable, "-m", "areno.platform", "bogus"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "usage" in out.stderr


def test_unmet_requirements(tmp_path):
    assert M.unmet_requirements(REPO) == []  # this venv: areno from this checkout, setup.cfg met
    (tmp_path / "setup.cfg").write_text(
        "[options]\ninstall_requires =\n    torch>=99  # comment\n    areno-no-such-dep\n    tqdm\n"
        "    some-windows-dep; platform_system == \"Windows\"\n"
        "[options.extras_require]\ntest =\n    pytest\n"
    )
    problems = M.unmet_requirements(tmp_path)
    assert problems[0] == f"areno is imported from {REPO}, not {tmp_path}"
    assert problems[1:] == [f"torch {importlib.metadata.version('torch')} does not satisfy >=99",
                            "areno-no-such-dep is not installed"]


def test_check_models_prints_the_registry_table(capsys):
    from areno.models.registry import supported_models_table
    from areno.platform.checks import run_check

    assert run_check(["--models"]) == 0
    out = capsys.readouterr().out
    assert out == supported_models_table() and "| OLMo 3 | `olmo3` |" in out and "OK" not in out.split("\n")[0]
