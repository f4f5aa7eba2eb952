"""JAX's persistent compilation cache, as every process of a run uses it (learner, actors, rollout
servers): one directory, and every program cached however fast it compiled -- an actor's sampler
programs compile in about a second each, under JAX's default threshold, and a restarted process or
the next actor on the host then reads them back instead of compiling again."""

from __future__ import annotations

import os
from pathlib import Path

# Where `stoker run` (and a pod's environment) names the run's cache for every child.
CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"


def enable_compilation_cache(directory: str | Path | None) -> None:
    """Turn on JAX's persistent compilation cache in ``directory`` (no-op when None)."""
    if directory is None:
        return
    import jax

    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _reset_cache()


def cache_enabled() -> bool:
    """Whether this process keeps compiled programs in a persistent cache."""
    import jax

    return bool(getattr(jax.config, "jax_compilation_cache_dir"))  # noqa: B009 - not in the type stubs


def disable_compilation_cache() -> None:
    """Turn the persistent compilation cache off again (in-process callers and tests)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", None)
    _reset_cache()


def _reset_cache() -> None:
    # JAX opens its cache once per process at the first compilation and ignores later changes of
    # the directory unless told to start over (the function is not public API; hence getattr).
    from jax._src import compilation_cache

    reset = getattr(compilation_cache, "reset_cache", None)
    if reset is not None:
        reset()


def cache_dir_for(configured: str | Path | None) -> str | None:
    """The spec's cache directory, else the one the environment names (None: no cache)."""
    return str(configured) if configured else os.environ.get(CACHE_DIR_ENV) or None
