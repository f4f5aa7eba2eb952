"""How many actors a job runs when its ``actors.replicas`` is unset.

On one machine (``stoker run``) an actor is a process that samples on the CPU: a CPU-bound actor
uses about one core, so more actors than the host has cores to spare only share them. The budget:
the cores this process may use (``os.sched_getaffinity``, and no more than its cgroup's CPU quota:
a container's CPU limit, which neither ``nproc`` nor the affinity mask shows), less one for the buffer, one per
learner process and one per rollout-server process; the rest go to actors. On a cluster each actor
is a pod with its own CPU, so the host does not bound them.

Either way admission bounds them: the buffer lets at most ``(maxStaleness + 1) x batchGroups x
groupSize`` episodes out at once (sizing/audit.py), so more actors than that many episodes fill at
``actors.concurrency`` each only wait for credit. ``minReplicas``/``maxReplicas`` clamp the count.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from stoker.spec import RLJobSpec

BUFFER_CORES = 1  # the buffer: gRPC and its log, light but always on
LEARNER_CORES = 1  # per learner process: its step (or, with a chip, feeding the chip)
ROLLOUT_CORES = 1  # per rollout-server process


@dataclass(frozen=True)
class ActorCount:
    """The actor count and the sentence that says where it comes from."""

    replicas: int
    why: str


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def affinity_mask() -> set[int] | None:
    """The cores this process may run on; None where the OS has no affinity masks (macOS, Windows)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:
        return None


def host_cores() -> int:
    """The cores this process may use: its affinity mask (``os.cpu_count`` where there is none),
    capped by its cgroup's CPU quota, rounded up (a quota of 3.5 cores feeds a 4th process a little)."""
    mask = affinity_mask()
    cores = len(mask) if mask is not None else os.cpu_count() or 1
    quota = cpu_quota_cores()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def cpu_quota_cores(root: Path = CGROUP_ROOT, membership: Path = PROC_CGROUP) -> float | None:
    """The CPU time this process's cgroup and its ancestors allow, in cores (quota / period, the
    smallest along the path); None without a limit or a readable cgroup file system.

    A Kubernetes container's ``limits.cpu`` and a VM's CPU cap are such quotas: 13 cores in the
    affinity mask under a quota of 4 run 4 cores' work, so 9 more actors would only wait."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: cpu.max holds "QUOTA PERIOD" or "max PERIOD"
            for folder in _ancestors(root, path):
                limits += _quota(folder / "cpu.max", None)
        elif "cpu" in controllers.split(","):  # cgroup v1: cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us
            mount = root / controllers if (root / controllers).is_dir() else root / "cpu"
            for folder in _ancestors(mount, path):
                limits += _quota(folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us")
    return min(limits) if limits else None


def _ancestors(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and each folder above it up to ``mount`` (a container sees its own cgroup
    as the root: then only ``mount`` itself)."""
    parts = [p for p in path.strip().split("/") if p]
    return [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _quota(quota_file: Path, period_file: Path | None) -> list[float]:
    try:
        fields = quota_file.read_text().split()
        if period_file is not None:
            fields.append(period_file.read_text().strip())
        quota, period = fields[0], float(fields[1])
    except (OSError, IndexError, ValueError):
        return []
    if quota in ("max", "-1") or period <= 0:
        return []
    try:
        return [float(quota) / period]
    except ValueError:
        return []


def admitted_episodes(spec: RLJobSpec) -> int:
    """The most episodes admission lets out at once: ``(maxStaleness + 1) x batchGroups x groupSize``."""
    return (spec.buffer.max_staleness + 1) * spec.learner.batch_groups * spec.buffer.group_size


def admitted_actors(spec: RLJobSpec) -> int:
    """Actors that admission can keep busy at ``actors.concurrency`` episodes each."""
    return max(1, math.ceil(admitted_episodes(spec) / spec.actors.concurrency))


def reserved_cores(*, learner_processes: int = 1, rollout_processes: int = 0) -> int:
    """Cores a local run keeps for everything but its actors."""
    return BUFFER_CORES + LEARNER_CORES * learner_processes + ROLLOUT_CORES * rollout_processes


def _clamped(spec: RLJobSpec, count: int) -> tuple[int, str]:
    low, high = max(1, spec.actors.min_replicas), spec.actors.max_replicas
    clamped = max(low, min(high, count))
    if clamped < count:
        return clamped, f"; actors.maxReplicas {high}"
    if clamped > count:
        return clamped, f"; actors.minReplicas {low}"
    return clamped, ""


def host_actors(spec: RLJobSpec, cores: int, *, learner_processes: int = 1, rollout_processes: int = 0) -> ActorCount:
    """A local run's actors: ``actors.replicas`` when set, else what ``cores`` can feed."""
    if spec.actors.replicas is not None:
        return ActorCount(spec.actors.replicas, "actors.replicas")
    reserved = reserved_cores(learner_processes=learner_processes, rollout_processes=rollout_processes)
    spare = max(1, cores - reserved)
    admitted = admitted_actors(spec)
    replicas, clamp = _clamped(spec, min(spare, admitted))
    quota = cpu_quota_cores()
    limit = " (the cgroup's CPU quota)" if quota is not None and math.ceil(quota) == cores else ""
    parts = [f"unset actors.replicas: {cores} cores{limit}, {BUFFER_CORES} for the buffer, "
             f"{LEARNER_CORES * learner_processes} for the learner"]
    if rollout_processes:
        parts.append(f"{ROLLOUT_CORES * rollout_processes} for the rollout server")
    parts.append(f"{spare} for actors" if cores > reserved else "none left for actors, so one all the same")
    why = ", ".join(parts)
    if admitted < spare:
        why += (f"; admission lets {admitted_episodes(spec)} episodes out at once, "
                f"{admitted} actor(s) at actors.concurrency {spec.actors.concurrency}")
    return ActorCount(replicas, why + clamp)


def cluster_actors(spec: RLJobSpec) -> int:
    """The operator's starting count: ``actors.replicas`` when set, else as many actors as
    admission keeps busy, within ``minReplicas``/``maxReplicas`` (its autoscaler moves it from there)."""
    if spec.actors.replicas is not None:
        return spec.actors.replicas
    return _clamped(spec, admitted_actors(spec))[0]


def replicas_text(spec: RLJobSpec) -> str:
    """``actors.replicas`` as advice quotes it: the number, or that it is unset."""
    return "unset" if spec.actors.replicas is None else str(spec.actors.replicas)
