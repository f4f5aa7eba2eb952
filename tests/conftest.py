"""Settings and fixtures for the whole suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests assert behaviour, never speed: hypothesis' per-example deadline (200 ms) is a
# timing assertion that fails on a loaded shared machine, so it is off everywhere.
settings.register_profile("stoker", deadline=None)
settings.load_profile("stoker")

# The dev extra installs libtpu (tests/sizing compile for TPU topologies ahead of time). Without
# this, JAX would probe for a TPU in every test process and log libtpu's start-up errors; TPU
# topologies compile with the CPU as JAX's platform, so nothing here needs the probe.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="module")
def xla_cache(xla_cache_dir: Path) -> Iterator[Path]:
    """One persistent XLA compilation cache per test session, for the modules that ask for it.

    Every ``Learner`` or ``Sampler`` builds fresh jitted functions, so without it each test would
    recompile the same tiny programs; it is turned off again after each module."""
    from stoker.learner.metrics import disable_compilation_cache, enable_compilation_cache

    enable_compilation_cache(xla_cache_dir)
    yield xla_cache_dir
    disable_compilation_cache()
