"""How many threads a CPU-sampling process gives XLA: its share of the host, not the whole host.

XLA's CPU client sizes its thread pools by the process's affinity mask when it starts (JAX has no
other knob). Eight actors on a 13-core host then each start pools of 13 threads that contend for
the cores, and so does a pod whose CPU limit is one core on a 64-core node. An actor's programs are
small (a token per row per call), so pools the size of its share are all it can use
(benchmarks/README.md, "XLA's CPU pools sized to an actor's share").

``start_jax_cpu(threads)`` narrows the mask while JAX's backends start and restores it after: the
pools are small, and their threads still run on any core. The share is ``STOKER_CPU_THREADS``
(``stoker run`` sets it for each actor: the cores left after the buffer and learner, divided among
the actors), else the cgroup's CPU quota (a pod's ``limits.cpu``).
"""

from __future__ import annotations

import logging
import math
import os

from stoker.actor_count import affinity_mask, cpu_quota_cores

CPU_THREADS_ENV = "STOKER_CPU_THREADS"

log = logging.getLogger("stoker.cpu_threads")


def cpu_share(env: dict[str, str] | None = None, quota: float | None = None) -> int | None:
    """The threads this process's XLA CPU pools should have: ``STOKER_CPU_THREADS`` when set,
    else the cgroup's CPU quota rounded up; None to leave XLA's own choice (no limit known).
    ``ValueError`` for a setting that is not a positive whole number."""
    env = dict(os.environ) if env is None else env
    text = env.get(CPU_THREADS_ENV, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{CPU_THREADS_ENV}={text!r}: expected a whole number of threads, 1 or more")
        return int(text)
    quota = cpu_quota_cores() if quota is None else quota
    return None if quota is None else max(1, math.ceil(quota))


def start_jax_cpu(threads: int | None) -> int | None:
    """Start JAX's backends with the CPU pools sized to ``threads`` (no change when None or at
    least the mask). Returns the size used, or None when JAX chose its own. Call it before anything
    else in the process touches JAX's backends: once they run, their pools are fixed."""
    mask = affinity_mask()
    if threads is None or mask is None or threads >= len(mask):
        return None
    import jax

    os.sched_setaffinity(0, sorted(mask)[:threads])
    try:
        jax.devices()  # starts every backend JAX will use, the CPU client among them
    finally:
        os.sched_setaffinity(0, mask)
    log.info("XLA's CPU thread pools sized to %d of this host's %d cores (%s)", threads, len(mask), CPU_THREADS_ENV)
    return threads
