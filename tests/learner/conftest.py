"""Shared by the learner's tests: one persistent XLA compilation cache per test session.

Every ``Learner`` builds fresh jitted step functions, so without it each test would recompile the
same tiny programs; with it, identical programs compile once per session (seconds per test saved).
Only modules that ask for ``xla_cache`` use it, and it is turned off again after each of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stoker.learner.metrics import disable_compilation_cache, enable_compilation_cache


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="module")
def xla_cache(xla_cache_dir: Path) -> Iterator[Path]:
    enable_compilation_cache(xla_cache_dir)
    yield xla_cache_dir
    disable_compilation_cache()
