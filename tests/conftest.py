"""Settings and fixtures for the whole suite."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
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
    from stoker.compilation_cache import disable_compilation_cache, enable_compilation_cache

    enable_compilation_cache(xla_cache_dir)
    yield xla_cache_dir
    disable_compilation_cache()



@pytest.fixture(scope="session")
def jax_cache_env(xla_cache_dir: Path) -> dict[str, str]:
    """The variables that point a subprocess's JAX at the session's compilation cache, keeping
    every program however fast it compiled (what ``stoker run`` sets for its children).

    Tests that run the same model (the examples, ``TINY_JOB``) then compile each program once per
    session instead of once per test, and nothing is written to the user's ~/.cache/stoker."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(xla_cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.fixture
def jax_env(jax_cache_env: dict[str, str]) -> dict[str, str]:
    """This test's environment (as monkeypatched so far) with ``jax_cache_env``, for its subprocesses."""
    return {**os.environ, **jax_cache_env}


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``tmpfs(size)`` mounts a tmpfs of ``size`` bytes for the test and returns its folder: a
    disk that really fills. Skips where mounting is not allowed (CI runs as root)."""
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        folder = tmp_path / f"tmpfs-{len(mounts)}"
        folder.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
        except OSError as exc:  # no mount(8) at all
            pytest.skip(f"cannot mount a tmpfs here: {exc}")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip() or done.returncode}")
        mounts.append(folder)
        return folder

    yield mount
    for folder in mounts:
        subprocess.run(["umount", "-l", str(folder)], check=False)
