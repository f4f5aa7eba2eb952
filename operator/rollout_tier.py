"""The rollout tier's API-facing steps, run by the status timer: observe the servers' workload, read
their Stats, scale, and make the children match (added, scaled, replaced or removed with
``spec.rollout``). Level-based like the rest of the timer: whatever changed the children, the
next look brings them back to the spec.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from stoker.labels import JOB_LABEL, ROLE_LABEL
from stoker.operator.control import Action, clamp_replicas
from stoker.operator.kube import RESOURCES, ApiError, Conflict, Kube, Manifest, NotFound
from stoker.operator.learner_workload import COMPLETION_INDEX_LABEL, JOBSET_API_VERSION
from stoker.operator.manifests import CONFIG_HASH_ANNOTATION, JobContext
from stoker.operator.naming import ROLE_ROLLOUT
from stoker.operator.rollout_control import RolloutReading, decide_rollout, rejected_since
from stoker.operator.rollout_workload import SERVER_LABEL, build_rollout, multi_host, rollout_config_hash, rollout_shape
from stoker.operator.rolloutstats import RolloutStatsReader
from stoker.operator.settings import OperatorSettings
from stoker.spec import RLJobSpec, RolloutSpec

DEPLOYMENT = RESOURCES[("apps/v1", "Deployment")]
SERVICE = RESOURCES[("v1", "Service")]
JOBSET = RESOURCES[(JOBSET_API_VERSION, "JobSet")]
ROLLOUT_POD_INDEX = "stoker_rollout_pods"

Logger = logging.Logger | logging.LoggerAdapter[Any]


@dataclass(frozen=True)
class RolloutPod:
    """What the operator's index keeps of a rollout pod: where its server answers Stats."""

    name: str
    ip: str
    ready: bool
    leader: bool
    """Serves ``stoker.v1.Rollout``: every single-host server pod, host 0 of a multi-host one."""
    server: str = ""
    """The multi-host server (JobSet index) this pod is a host of; "" in a single-host Deployment."""
    host: int = 0
    """Its completion index in that server (0 for single-host pods)."""


def index_rollout_pods(name: str, labels: Mapping[str, str], annotations: Mapping[str, str], status: Mapping[str, Any],
                       meta: Mapping[str, Any], namespace: str | None, **_: Any) -> Any:
    """kopf index: rollout pods by (namespace, job). A terminating pod counts as not ready (its
    server's replacement may already be starting beside it)."""
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    # The Job controller sets the completion index as a label (Kubernetes >= 1.28) and an annotation.
    index = labels.get(COMPLETION_INDEX_LABEL) or annotations.get(COMPLETION_INDEX_LABEL) or "0"
    pod = RolloutPod(
        name=name,
        ip=str(status.get("podIP") or ""),
        ready=conditions.get("Ready") == "True" and not meta.get("deletionTimestamp"),
        leader=index == "0",
        server=labels.get(SERVER_LABEL, ""),
        host=int(index) if index.isdigit() else -1,
    )
    return {(namespace, labels[JOB_LABEL]): pod}


def server_addresses(pods: Iterable[RolloutPod], port: int, hosts: int = 1) -> list[str]:
    """``ip:port`` of every server that can answer Stats, sorted: each ready single-host server
    pod, and host 0 of each multi-host server (``hosts`` pods) once all its hosts are ready. The
    other hosts of a multi-host server serve only gRPC health (their probes pass) and answer Stats
    UNIMPLEMENTED, so they are never addressed; a server still missing hosts cannot generate."""
    pods = list(pods)
    ready_hosts: dict[str, set[int]] = {}
    for pod in pods:
        if pod.ready and pod.server:
            ready_hosts.setdefault(pod.server, set()).add(pod.host)
    addresses = set()
    for pod in pods:
        if not (pod.ready and pod.leader and pod.ip):
            continue
        if hosts > 1 and (not pod.server or len(ready_hosts.get(pod.server, ())) < hosts):
            continue
        addresses.add(f"{pod.ip}:{port}")
    return sorted(addresses)


def rollout_target(spec: RLJobSpec, status: Mapping[str, Any]) -> int:
    """The operator's rollout-server target: spec.rollout.replicas unless scaling moved it, clamped
    to min/maxReplicas. An edit of ``rollout.replicas`` resets it: the status keeps the value the
    target last started from (``specReplicas``), so a status written from an older look of the job
    cannot keep an edit from taking effect."""
    rollout = spec.rollout
    if rollout is None:
        return 0
    before = status.get("rollout") or {}
    previous = before.get("desired")
    wanted = rollout.replicas if previous is None or before.get("specReplicas") != rollout.replicas else int(previous)
    return clamp_replicas(wanted, rollout.min_replicas, rollout.max_replicas)


def seeded_status(rollout: RolloutSpec, status: Mapping[str, Any], target: int) -> dict[str, Any]:
    """``status.rollout`` with a (re)computed target, written when the spec is applied."""
    before = dict(status.get("rollout") or {})
    ready = int(before.get("ready") or 0)
    return {**before, "desired": target, "ready": ready, "summary": f"{ready}/{target}", "specReplicas": rollout.replicas}


def rollout_blocked(ctx: JobContext) -> str | None:
    """Why no rollout server can run on this cluster (None when they can)."""
    rollout = ctx.spec.rollout
    if rollout is None or ctx.jobset_api or not ctx.streams or not multi_host(rollout):
        return None
    return ("a multi-host TPU rollout tier runs one JobSet per server and the cluster does not serve "
            "jobset.x-k8s.io/v1alpha2: install JobSet, or use a single-host topology")


@dataclass(frozen=True)
class RolloutObservation:
    ready: int = 0
    """Ready servers: Deployment pods, or multi-host JobSets with their slice ready."""
    deployment: Manifest | None = None
    jobsets: tuple[Manifest, ...] = ()


def _get(kube: Kube, res: Any, namespace: str, name: str) -> Manifest | None:
    try:
        return kube.get(res, namespace, name)
    except NotFound:
        return None


def _ours(objs: Iterable[Manifest], job: str) -> tuple[Manifest, ...]:
    """Filtered here as well as by the label selector (an emulator may ignore selectors)."""
    out = []
    for obj in objs:
        meta_labels = (obj.get("metadata") or {}).get("labels") or {}
        if meta_labels.get(JOB_LABEL) == job and meta_labels.get(ROLE_LABEL) == ROLE_ROLLOUT:
            out.append(obj)
    return tuple(sorted(out, key=lambda o: str(o["metadata"]["name"])))


def _jobset_ready(obj: Manifest) -> bool:
    status = obj.get("status") or {}
    failed = any(c.get("type") == "Failed" and c.get("status") == "True" for c in status.get("conditions") or [])
    return not failed and sum(int(r.get("ready") or 0) for r in status.get("replicatedJobsStatus") or []) >= 1


def observe_rollout(kube: Kube, ctx: JobContext) -> RolloutObservation:
    deployment = _get(kube, DEPLOYMENT, ctx.namespace, ctx.names.rollout)
    jobsets: tuple[Manifest, ...] = ()
    if ctx.jobset_api:
        jobsets = _ours(kube.list(JOBSET, ctx.namespace, label_selector=f"{JOB_LABEL}={ctx.name},{ROLE_LABEL}={ROLE_ROLLOUT}"), ctx.name)
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    ready += sum(1 for j in jobsets if _jobset_ready(j))
    return RolloutObservation(ready=ready, deployment=deployment, jobsets=jobsets)


def _delete(kube: Kube, res: Any, namespace: str, name: str) -> bool:
    try:
        kube.delete(res, namespace, name)
    except NotFound:
        return False
    return True


def sync_rollout(kube: Kube, ctx: JobContext, observed: RolloutObservation) -> list[str]:
    """Make the rollout children match ``ctx`` (its ``rollout_replicas``): create what is missing,
    delete what is not wanted (servers above the target, a workload of the other shape, all of
    them without ``spec.rollout``), replace a multi-host server whose config changed or that
    failed for good. Returns what it did, e.g. ``["created JobSet/lake-rollout-2"]``."""
    desired = {(m["kind"], m["metadata"]["name"]): m for m in build_rollout(ctx)}
    done: list[str] = []
    if observed.deployment is not None and ("Deployment", ctx.names.rollout) not in desired:
        if _delete(kube, DEPLOYMENT, ctx.namespace, ctx.names.rollout):
            done.append(f"deleted Deployment/{ctx.names.rollout}")
    if ("Service", ctx.names.rollout) not in desired and _delete(kube, SERVICE, ctx.namespace, ctx.names.rollout):
        done.append(f"deleted Service/{ctx.names.rollout}")
    wanted_hash = rollout_config_hash(ctx) if ctx.spec.rollout is not None else ""
    present: set[str] = set()
    for jobset in observed.jobsets:
        name = str(jobset["metadata"]["name"])
        stale = ((jobset["metadata"].get("annotations") or {}).get(CONFIG_HASH_ANNOTATION) != wanted_hash
                 or any(c.get("type") == "Failed" and c.get("status") == "True"
                        for c in (jobset.get("status") or {}).get("conditions") or []))
        if ("JobSet", name) not in desired or stale:
            if _delete(kube, JOBSET, ctx.namespace, name):
                done.append(f"deleted JobSet/{name}")
        else:
            present.add(name)
    for (kind, name), manifest in desired.items():
        if kind == "JobSet" and name in present:
            continue
        if kind == "Deployment" and observed.deployment is not None:
            if int((observed.deployment.get("spec") or {}).get("replicas") or 0) != ctx.rollout_replicas:
                kube.patch(DEPLOYMENT, ctx.namespace, name, {"spec": {"replicas": ctx.rollout_replicas}})
                done.append(f"scaled Deployment/{name} to {ctx.rollout_replicas}")
            continue
        if kind == "Service" and observed.deployment is not None or kind == "Service" and present:
            continue  # created with its workload; reconcile patches it on spec edits
        try:
            kube.create(manifest)
            done.append(f"created {kind}/{name}")
        except Conflict:
            pass
    return done


@dataclass(frozen=True)
class RolloutLook:
    """What one look at the rollout tier found and did, for the status."""

    target: int
    observed: RolloutObservation
    reading: RolloutReading
    actions: tuple[Action, ...] = field(default_factory=tuple)
    done: tuple[str, ...] = ()
    """What it did to the children, e.g. ``("deleted JobSet/lake-rollout-1",)``."""


def look_after_rollout(
    kube: Kube,
    reader: RolloutStatsReader,
    settings: OperatorSettings,
    ctx: JobContext,
    *,
    target: int,
    pods: Iterable[RolloutPod],
    memo: Any,
    now: datetime,
    starved: bool | None,
    running: bool,
    logger: Logger,
) -> RolloutLook | None:
    """Observe, read Stats, scale ``target`` (while ``running``: not suspended, not finished; else
    the servers go to 0 and the target is kept for later) and sync. None when the job has no
    rollout tier (its children, if any were left, are deleted)."""
    rollout = ctx.spec.rollout
    if rollout is None or not ctx.streams:
        done = sync_rollout(kube, replace(ctx, rollout_replicas=0), observe_rollout(kube, ctx))
        if done:
            logger.info("rollout tier removed: %s", ", ".join(done))
        reader.forget(memo.pop("rollout_addresses", []))
        return None
    observed = observe_rollout(kube, ctx)
    pods = list(pods)
    addresses = server_addresses(pods, rollout.port, rollout_shape(rollout).hosts)
    reader.forget([a for a in memo.get("rollout_addresses", []) if a not in addresses])
    memo["rollout_addresses"] = addresses
    reading = reader.read_all(addresses)
    reading = replace(reading, rejected=rejected_since(memo.get("rollout_rejected", {}), reading.servers))
    memo["rollout_rejected"] = {s.address: s.rejected_total for s in reading.servers}
    actions: tuple[Action, ...] = ()
    if running:
        last = memo.get("last_rollout_scaled")
        decision = decide_rollout(
            target=target, min_replicas=rollout.min_replicas, max_replicas=rollout.max_replicas, reading=reading,
            expected_servers=len(addresses), starved=starved,
            cooled_down=last is None or (now - last).total_seconds() >= settings.scale_cooldown_seconds, settings=settings,
        )
        if decision.target != target:
            memo["last_rollout_scaled"] = now
        target, actions = decision.target, decision.actions
    try:
        done = sync_rollout(kube, replace(ctx, rollout_replicas=target if running else 0), observed)
    except ApiError as exc:
        raise ApiError(exc.status, f"rollout tier: {exc.message}") from None
    if done:
        logger.info("rollout tier: %s", ", ".join(done))
    return RolloutLook(target=target, observed=observed, reading=reading, actions=tuple(actions), done=tuple(done))
