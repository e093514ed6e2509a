"""Session-wide runs of the split-mode tests (tests/helpers/split_runs.py): the tiny checkpoint, data and reward, and
the runs several test files compare against (the colocated run, on-policy split, async split, LoRA split), each run
once per session."""

import pytest

from tests.helpers.split_runs import ASYNC, LORA_SPLIT, ON_POLICY, areno, make_files


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("split"))


@pytest.fixture(scope="session")
def colocated(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated") / "run"
    areno(files, out)
    return out


@pytest.fixture(scope="session")
def on_policy_split(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("on-policy") / "split"
    areno(files, out, *ON_POLICY, ARENO_VERIFY_POLICY_SYNC="1")
    return out


@pytest.fixture(scope="session")
def async_split(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("async") / "async"
    areno(files, out, *ASYNC, steps=4)
    return out


@pytest.fixture(scope="session")
def lora_split(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "split"
    areno(files, out, *LORA_SPLIT, ARENO_VERIFY_POLICY_SYNC="1")
    return out
