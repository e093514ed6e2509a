"""Session-wide runs of the split-mode tests (tests/helpers/split_runs.py): the tiny checkpoint, data and reward, and
the runs several test files compare against (the colocated run, on-policy split, async split, LoRA split), each run
once per session."""

import pytest

from tests.helpers.split_runs import ASYNC, LORA_SPLIT, ON_POLICY, areno, make_files


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("split"))


def run(tmp_path_factory, files, name, *extra, **kw):
    out = tmp_path_factory.mktemp(name) / "run"
    areno(files, out, *extra, **kw)
    return out


@pytest.fixture(scope="session")
def colocated(files, tmp_path_factory):
    return run(tmp_path_factory, files, "colocated")


@pytest.fixture(scope="session")
def on_policy_split(files, tmp_path_factory):
    return run(tmp_path_factory, files, "on-policy", *ON_POLICY, ARENO_VERIFY_POLICY_SYNC="1")


@pytest.fixture(scope="session")
def async_split(files, tmp_path_factory):
    return run(tmp_path_factory, files, "async", *ASYNC, steps=4)


@pytest.fixture(scope="session")
def lora_split(files, tmp_path_factory):
    return run(tmp_path_factory, files, "lora", *LORA_SPLIT, ARENO_VERIFY_POLICY_SYNC="1")
