"""What one look at a job aims for: the actor replica target and the ``JobContext`` the builders get.

The actor target is ``spec.actors.replicas`` until enforcement (``control.decide``) moves it; the
status keeps where it stands (``status.actors.desired``), for the next look. ``replicas_changed``
and ``actor_target`` are pure; ``job_context`` asks the runtime whether the cluster serves JobSet
(a cached discovery call).
"""

from __future__ import annotations

from typing import Any

from stoker.actor_count import cluster_actors
from stoker.operator.control import clamp_replicas
from stoker.operator.lifecycle import field_values
from stoker.operator.manifests import JobContext
from stoker.operator.reconcile import Runtime
from stoker.spec import RLJobSpec

REPLICAS_PATH = ("spec", "actors", "replicas")


def replicas_changed(diff: Any) -> bool:
    """Whether a kopf diff changes ``spec.actors.replicas``, however it is reported: the field
    itself, or a whole ``spec.actors`` block added or replaced (kopf reports the block's path)."""
    return any(True for _ in field_values(diff, REPLICAS_PATH))


def actor_target(spec: RLJobSpec, status: dict[str, Any], diff: Any) -> int:
    """The operator's actor replica target: spec.actors.replicas unless enforcement moved it.

    A spec change of ``actors.replicas`` resets the target; min/max changes clamp it. Unset, it
    starts at as many actors as admission keeps busy (``stoker.actor_count.cluster_actors``).
    """
    actors = spec.actors
    changed = replicas_changed(diff)
    previous = (status.get("actors") or {}).get("desired")
    if changed or previous is None:
        return clamp_replicas(cluster_actors(spec), actors.min_replicas, actors.max_replicas)
    return clamp_replicas(int(previous), actors.min_replicas, actors.max_replicas)


def job_context(runtime: Runtime, name: str, namespace: str, uid: str, spec: RLJobSpec, target: int, scale: float,
                rollout: int = 0) -> JobContext:
    """The builders' view of the job for this look: a suspended job runs no actors or rollout servers."""
    return JobContext(
        name=name,
        namespace=namespace,
        uid=uid,
        spec=spec,
        settings=runtime.settings,
        actor_replicas=0 if spec.suspend else target,
        jobset_api=runtime.jobset_api(),
        admission_scale=scale,
        rollout_replicas=0 if spec.suspend else rollout,
    )
