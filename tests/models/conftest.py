"""Shared fixtures for the model tests: tiny random HF checkpoints (cached per session)."""

import pytest

from areno.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family, seed=0, **overrides) -> Path`` (written once per distinct arguments)."""
    cache = {}

    def make(family, seed=0, **overrides):
        key = (family, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-ckpt")
            cache[key] = make_tiny_checkpoint(path, family, seed=seed, **overrides)
        return cache[key]

    return make
