"""Test-wide set-up.

Without CUDA, Triton kernels run in the interpreter, which must be switched on before triton is imported, so it is
set here, first. The CPU suite then runs native kernels by default (ARENO_KERNELS=native), and kernel tests ask for
the Triton path explicitly with the ``triton_kernels`` fixture.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("ARENO_KERNELS", "native")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def triton_kernels(monkeypatch):
    """Run the Triton path of every kernel (interpreted on CPU)."""
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    yield


@pytest.fixture
def native_kernels(monkeypatch):
    monkeypatch.setenv("ARENO_KERNELS", "native")
    yield


@pytest.fixture(scope="session")
def quickstart_home(tmp_path_factory):
    """One $ARENO_HOME for the session's runs of `areno train --preset quickstart` (subprocesses): the first trains
    the preset's 500-step SFT warm-up, the next ones with the same inputs load its cached state (bit for bit the
    same: areno/rl/warmup_cache.py, tests/rl/test_warmup_cache.py)."""
    return tmp_path_factory.mktemp("areno-home")
