"""One pod's ``status`` -> how often its containers restarted, why they last stopped, and whether
they are stuck waiting (the figures behind the RLJob's ``Degraded``/``Recovering`` conditions)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Waiting reasons the kubelet does not get out of by itself: a crash loop, an image it cannot pull,
# a container it cannot create. A pod in one of them is down, not coming back.
BACK_OFF_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})

# The ``DisruptionTarget`` condition the scheduler, the eviction API, the taint manager or pod GC set
# on a pod before deleting it (Kubernetes 1.26+): why a replaced pod went, in the words of restarts.
# The taint manager and pod GC mostly act on a node that went away (unreachable, or deleted).
DISRUPTIONS = {
    "PreemptionByScheduler": "Preempted", "PreemptionByKubeScheduler": "Preempted",
    "EvictionByEvictionAPI": "Evicted", "TerminationByKubelet": "Evicted",
    "DeletionByTaintManager": "NodeLost", "DeletionByPodGC": "NodeLost",
}


@dataclass(frozen=True)
class PodHealth:
    restarts: int = 0
    """Sum of the containers' ``restartCount`` (init containers included)."""
    last_reason: str = ""
    """Why a container last terminated (``OOMKilled``, ``Error``...), or the pod's own reason
    (``Evicted``) when it failed as a whole."""
    last_finished: str = ""
    """When that termination happened (RFC 3339, as the kubelet wrote it; "" if unknown)."""
    waiting: str = ""
    """A back-off reason (``BACK_OFF_REASONS``) a container waits in now; "" otherwise."""
    finished: bool = False
    """Phase ``Failed`` or ``Succeeded``: an evicted pod stays listed, but nothing runs in it."""
    failed: bool = False
    """Phase ``Failed``."""
    disruption: str = ""
    """Why the pod as a whole is going, where it says: its own ``reason`` (``Evicted``, ``NodeLost``,
    ``Shutdown``) or its ``DisruptionTarget`` condition (``DISRUPTIONS``); "" otherwise."""


def _terminations(container: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(finishedAt, reason) of a container's current and previous terminations."""
    out = []
    for key in ("state", "lastState"):
        terminated = (container.get(key) or {}).get("terminated")
        if terminated:
            out.append((str(terminated.get("finishedAt") or ""), str(terminated.get("reason") or "")))
    return out


def pod_health(status: Mapping[str, Any] | None) -> PodHealth:
    """Read a pod's ``status``; an empty or absent one (not scheduled yet) is a healthy pod."""
    status = status or {}
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    restarts = sum(int(c.get("restartCount") or 0) for c in containers)
    stops = [t for c in containers for t in _terminations(c) if t[1]]
    finished_at, reason = max(stops) if stops else ("", "")  # RFC 3339 UTC strings sort by time
    if not reason and status.get("reason"):
        reason = str(status["reason"])  # the whole pod failed: Evicted, NodeLost, DeadlineExceeded
    waiting = next(
        (str(w) for c in containers if (w := ((c.get("state") or {}).get("waiting") or {}).get("reason")) in BACK_OFF_REASONS),
        "",
    )
    disrupted = next((str(c.get("reason") or "") for c in status.get("conditions") or []
                      if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), "")
    return PodHealth(
        restarts=restarts,
        last_reason=reason,
        last_finished=finished_at,
        waiting=waiting,
        finished=status.get("phase") in ("Failed", "Succeeded"),
        failed=status.get("phase") == "Failed",
        disruption=str(status.get("reason") or "") or DISRUPTIONS.get(disrupted, disrupted),
    )
