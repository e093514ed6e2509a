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
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: two workers share the cores, one intra-op thread each
    torch.set_num_threads(1)

# Session fixtures cheap enough to build once per xdist worker; the other session fixtures of tests/ (whole training
# runs) keep every test that uses them on one worker.
CHEAP_SESSION_FIXTURES = {"files"}


def _xdist_groups(items):
    """Under ``--dist loadgroup``: tests sharing a module-scoped fixture, or one of tests/' costly session fixtures,
    are joined (transitively) into one ``xdist_group``, so no fixture is built on two workers."""
    parent = {}

    def find(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        own = []
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            scope, baseid = defs[-1].scope, defs[-1].baseid or ""
            if scope == "module":
                own.append(item.nodeid.split("::")[0])
            elif scope == "session" and baseid.startswith("tests") and name not in CHEAP_SESSION_FIXTURES:
                own.append("session:" + name)
        for key in own[1:]:
            parent[find(key)] = find(own[0])
        keys[item] = own
    for item, own in keys.items():
        if own:
            item.add_marker(pytest.mark.xdist_group(find(own[0])))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _xdist_groups(items)
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


@pytest.fixture
def areno_home(tmp_path, monkeypatch):
    """A fresh $ARENO_HOME (the quickstart's data, models and warm-up cache); the preset's thread count undone."""
    home = tmp_path / "home"
    monkeypatch.setenv("ARENO_HOME", str(home))
    threads = torch.get_num_threads()  # the preset picks one CPU thread for this process
    yield home
    torch.set_num_threads(threads)
