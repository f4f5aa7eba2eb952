"""Zombie sandbox pods: whose actor pod is gone (deleted, or dead: evicted and still listed), or
whose heartbeat is older than the TTL.

The operator keeps a kopf index of the pods labelled with a job (no API calls, no per-pod timer
and so no finalizer on sandbox pods); each RLJob's timer passes its slice of the index here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from stoker.labels import ACTOR_LABEL, HEARTBEAT_ANNOTATION, JOB_LABEL, ROLE_LABEL, ROLE_SANDBOX, parse_rfc3339
from stoker.operator.naming import ROLE_ACTOR, ROLE_LEARNER
from stoker.operator.podhealth import PodHealth, pod_health

TEMPLATE_HASH_LABEL = "pod-template-hash"  # the Deployment's ReplicaSet
REVISION_HASH_LABEL = "controller-revision-hash"  # a StatefulSet's or DaemonSet's
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"

# Pods that may own sandboxes: actors, and the learner in colocated mode.
SANDBOX_OWNER_ROLES = frozenset({ROLE_ACTOR, ROLE_LEARNER})


@dataclass(frozen=True)
class PodRecord:
    """What the index keeps of one pod of a job."""

    name: str
    role: str
    actor: str | None = None
    """Sandbox pods: the pod that created it (label or annotation ``stoker.dev/actor``)."""
    heartbeat: datetime | None = None
    created: datetime | None = None
    deleting: bool = False
    health: PodHealth = PodHealth()
    """Restarts and termination reasons, for the job's Degraded/Recovering conditions."""
    uid: str = ""
    revision: str = ""
    """Its template's hash (``pod-template-hash``): a replacement of another hash is a rollout."""
    jobset: bool = False
    """Made by a JobSet, which counts the restarts of its pods' group itself."""


@dataclass(frozen=True)
class Zombie:
    name: str
    reason: str


def _time(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return parse_rfc3339(text)
    except ValueError:
        return None


def pod_record(
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    meta: Mapping[str, Any],
    status: Mapping[str, Any] | None = None,
) -> PodRecord:
    return PodRecord(
        name=name,
        role=labels.get(ROLE_LABEL, ""),
        actor=labels.get(ACTOR_LABEL) or annotations.get(ACTOR_LABEL),
        heartbeat=_time(annotations.get(HEARTBEAT_ANNOTATION)),
        created=_time(meta.get("creationTimestamp")),
        deleting=bool(meta.get("deletionTimestamp")),
        health=pod_health(status),
        uid=str(meta.get("uid") or ""),
        revision=labels.get(TEMPLATE_HASH_LABEL) or labels.get(REVISION_HASH_LABEL) or "",
        jobset=JOBSET_NAME_LABEL in labels,
    )


def find_zombies(pods: Iterable[PodRecord], now: datetime, ttl_seconds: float) -> list[Zombie]:
    """Sandbox pods of one job to delete, with why; pods already being deleted are skipped.

    A sandbox without a heartbeat yet is judged by its creation time, so a sandbox whose actor
    died before the first heartbeat is still reaped after the TTL.
    """
    pods = list(pods)
    # An evicted actor pod stays listed (phase Failed) until it is garbage-collected, long after the
    # Deployment replaced it: its sandboxes are orphans as much as those of a deleted one.
    owners = {p.name for p in pods if p.role in SANDBOX_OWNER_ROLES and not p.deleting and not p.health.finished}
    dead = {p.name: p.health.last_reason or "finished" for p in pods if p.role in SANDBOX_OWNER_ROLES and p.health.finished}
    zombies: list[Zombie] = []
    for pod in sorted(pods, key=lambda p: p.name):
        if pod.role != ROLE_SANDBOX or pod.deleting:
            continue
        if not pod.actor:
            zombies.append(Zombie(pod.name, "no owning actor recorded"))
            continue
        if pod.actor not in owners:
            gone = f"dead ({dead[pod.actor]})" if pod.actor in dead else "gone"
            zombies.append(Zombie(pod.name, f"actor {pod.actor} is {gone}"))
            continue
        seen = pod.heartbeat or pod.created
        if seen is not None and (now - seen).total_seconds() > ttl_seconds:
            zombies.append(Zombie(pod.name, f"no heartbeat for {(now - seen).total_seconds():.0f}s (TTL {ttl_seconds:g}s)"))
    return zombies


def job_sandboxes(pods: Iterable[Mapping[str, Any]], job: str) -> list[str]:
    """Names of ``job``'s sandbox pods not already going, from listed pod manifests.

    Filtered here as well as by the server's label selector, so a server (or emulator) that
    ignores the selector cannot make the operator delete another job's pods."""
    names = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(JOB_LABEL) == job and labels.get(ROLE_LABEL) == ROLE_SANDBOX and not meta.get("deletionTimestamp"):
            names.append(str(meta.get("name")))
    return names
