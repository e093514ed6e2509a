"""Shared fixtures for the model tests: tiny random HF checkpoints (cached per session)."""

import pytest

from areno.testing import FAMILIES, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family, seed=0, **overrides) -> Path`` (written once per distinct arguments)."""
    cache = {}

    def make(family, seed=0, **overrides):
        key = (family, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if family in FAMILIES:  # a family newer than the installed transformers (e.g. the GPU image's) is skipped
            transformers = pytest.importorskip("transformers")
            if not hasattr(transformers, FAMILIES[family][0]):
                pytest.skip(f"transformers {transformers.__version__} has no {FAMILIES[family][0]}")
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-ckpt")
            cache[key] = make_tiny_checkpoint(path, family, seed=seed, **overrides)
        return cache[key]

    return make
