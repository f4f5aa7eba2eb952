"""The operator's API-facing steps, kept out of the kopf handlers so they stay thin.

``apply_children`` makes the cluster match ``desired_children``; ``observe`` reads the children
back; both take a ``Kube`` and plain values, and raise ``kube.ApiError`` for the handlers to map
onto kopf's retry semantics.
"""

from __future__ import annotations

import base64
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from stoker.operator.bufferstats import StatsReader, StatsUnavailable
from stoker.operator.children import desired_children
from stoker.operator.kube import RESOURCES, ApiError, Conflict, Kube, Manifest, NotFound, resource_of
from stoker.operator.learner_workload import JOBSET_API_VERSION, learner_shape
from stoker.operator.control import (
    StalenessWindow,
    learner_starved,
    overproducing,
    staleness_exceeded,
    staleness_window,
)
from stoker.operator.manifests import (
    JOB_FILE_KEY,
    JobContext,
    build_buffer_control_configmap,
    build_buffer_token_secret,
)
from stoker.operator.metrics import OperatorMetrics
from stoker.operator.naming import Names
from stoker.operator.observe import (
    DeploymentObservation,
    LearnerObservation,
    StatsSnapshot,
    observe_deployment,
    observe_indexed_jobs,
    observe_jobset,
)
from stoker.operator.rollout import LIVE_SPEC_NAMES, live_buffer_changes
from stoker.operator.rolloutstats import RolloutStatsReader
from stoker.operator.settings import OperatorSettings
from stoker.operator.tpu import TopologyError
from stoker.spec import RLJob, RLJobSpec, cross_field_problems, name_problems

DEPLOYMENT = RESOURCES[("apps/v1", "Deployment")]
CONFIGMAP = RESOURCES[("v1", "ConfigMap")]
SECRET = RESOURCES[("v1", "Secret")]
SERVICE = RESOURCES[("v1", "Service")]
JOB = RESOURCES[("batch/v1", "Job")]
JOBSET = RESOURCES[(JOBSET_API_VERSION, "JobSet")]
POD = RESOURCES[("v1", "Pod")]

# What of an existing child is brought back to the desired manifest (with its labels and owner
# reference); kinds with nothing listed (PVC sizes, Job templates, the generated token) are left
# as created.
PATCHABLE_FIELDS: dict[str, tuple[str, ...]] = {
    "ConfigMap": ("data",),
    "Deployment": ("spec",),
    "Service": ("spec",),
    "ServiceAccount": (),
    "Role": ("rules",),
    "RoleBinding": ("subjects",),
    "NetworkPolicy": ("spec",),
    "PersistentVolumeClaim": (),
    "JobSet": (),
    "Job": (),
}


class InvalidJob(Exception):
    """A spec the operator cannot run; ``reason`` is the condition reason, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def parse_spec(name: str, spec: Any) -> RLJobSpec:
    """The typed spec, or ``InvalidJob`` listing every problem (topology included)."""
    try:
        parsed = RLJobSpec.model_validate(dict(spec or {}))
    except ValidationError as exc:
        details = "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise InvalidJob("InvalidSpec", details) from None
    if parsed.learner.accelerator != "cpu" and parsed.learner.topology is not None:
        try:
            learner_shape(parsed.learner)
        except TopologyError as exc:
            raise InvalidJob("InvalidTopology", f"spec.learner.topology: {exc}") from None
    problems = [f"metadata.name: {message}" for message in name_problems(name, parsed)]
    problems += [f"spec.{path}: {message}" for path, message in cross_field_problems(parsed)]
    if problems:
        raise InvalidJob("InvalidSpec", "; ".join(problems))
    return parsed


@dataclass
class Runtime:
    """Operator-wide state shared by all handlers (kept in kopf's memo)."""

    settings: OperatorSettings
    kube: Kube
    stats: StatsReader
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    rollout_stats: RolloutStatsReader = field(default_factory=RolloutStatsReader)
    _jobset: tuple[float, bool] | None = None
    _tokens: dict[tuple[str, str, str], str] = field(default_factory=dict)

    def jobset_api(self) -> bool:
        """Whether the cluster serves JobSet, cached for ``jobset_discovery_seconds``."""
        now = time.monotonic()
        if self._jobset is None or now - self._jobset[0] > self.settings.jobset_discovery_seconds:
            group, version = JOBSET_API_VERSION.split("/")
            self._jobset = (now, self.kube.serves(group, version, JOBSET.plural))
        return self._jobset[1]

    def token(self, namespace: str, secret: str, key: str) -> str | None:
        cache_key = (namespace, secret, key)
        if cache_key not in self._tokens:
            try:
                data = self.kube.get(SECRET, namespace, secret).get("data") or {}
            except NotFound:
                return None
            if key not in data:
                return None
            self._tokens[cache_key] = base64.b64decode(data[key]).decode()
        return self._tokens[cache_key]

    def forget_token(self, namespace: str, secret: str, key: str) -> None:
        self._tokens.pop((namespace, secret, key), None)

    def forget(self, namespace: str, name: str) -> None:
        self._tokens = {k: v for k, v in self._tokens.items() if k[0] != namespace or not k[1].startswith(name)}


def applied_spec(kube: Kube, namespace: str, name: str) -> RLJobSpec | None:
    """The spec the children run: the job file in ``<job>-spec`` (None if there is none yet).

    When an edit is refused, the operator keeps observing and healing the job with this one.
    """
    try:
        config = kube.get(CONFIGMAP, namespace, Names(name).spec_config)
    except NotFound:
        return None
    try:
        return RLJob.model_validate(yaml.safe_load((config.get("data") or {}).get(JOB_FILE_KEY, ""))).spec
    except (ValidationError, yaml.YAMLError):
        return None


def _subset(manifest: Manifest, fields: tuple[str, ...]) -> Manifest:
    meta = manifest["metadata"]
    patch: Manifest = {"metadata": {"labels": meta.get("labels", {}), "ownerReferences": meta["ownerReferences"]}}
    if meta.get("annotations"):
        patch["metadata"]["annotations"] = meta["annotations"]
    for key in fields:
        if key in manifest:
            patch[key] = manifest[key]
    return patch


def ensure_token_secret(kube: Kube, ctx: JobContext) -> bool:
    """Create the generated buffer token once; True if this call created it."""
    if ctx.spec.buffer.auth_secret_ref is not None or not ctx.streams:
        return False
    try:
        kube.create(build_buffer_token_secret(ctx, secrets.token_urlsafe(32)))
    except Conflict:
        return False  # created before: the first token stays, so running pods keep working
    return True


def apply_children(
    kube: Kube, ctx: JobContext, *, patch_existing: bool, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> list[str]:
    """Create every missing child; with ``patch_existing`` also patch existing ones to the spec.

    Returns "Kind/name" of the children created.
    """
    created: list[str] = []
    if ensure_token_secret(kube, ctx):
        created.append(f"Secret/{ctx.names.buffer_token}")
    for manifest in desired_children(ctx):
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        try:
            try:
                kube.create(manifest)
                created.append(f"{kind}/{name}")
            except Conflict:
                if patch_existing and PATCHABLE_FIELDS[kind]:
                    res = resource_of(manifest["apiVersion"], kind)
                    kube.patch(res, ctx.namespace, name, _subset(manifest, PATCHABLE_FIELDS[kind]))
        except ApiError as exc:  # stop at the first refusal: nothing after it runs without it
            raise ApiError(exc.status, f"{kind} {name}: {exc.message}") from None
    if created:
        logger.info("created %s", ", ".join(created))
    return created


def remove_learner(kube: Kube, ctx: JobContext, *, jobset_api: bool) -> bool:
    """Delete the learner workload (suspend); its pods get SIGTERM and checkpoint first.

    Foreground deletion keeps the workload object until its pods are gone, so the status can
    say "Checkpointing" meanwhile. True if anything was deleted.
    """
    names = ctx.names
    targets = [(JOBSET, names.learner)] if jobset_api else [
        *((JOB, names.learner_slice_job(s)) for s in range(ctx.spec.learner.num_slices)),
        (SERVICE, names.learner),
    ]
    deleted = False
    for res, name in targets:
        try:
            kube.delete(res, ctx.namespace, name, propagation="Foreground")
            deleted = True
        except NotFound:
            pass
    return deleted


def _get(kube: Kube, res: Any, namespace: str, name: str) -> Manifest | None:
    try:
        return kube.get(res, namespace, name)
    except NotFound:
        return None


@dataclass(frozen=True)
class Children:
    learner: LearnerObservation
    actors: DeploymentObservation | None
    buffer: DeploymentObservation | None


def observe_children(kube: Kube, ctx: JobContext, *, jobset_api: bool) -> Children:
    names: Names = ctx.names
    slices = ctx.spec.learner.num_slices
    if jobset_api:
        learner = observe_jobset(_get(kube, JOBSET, ctx.namespace, names.learner), slices)
    else:
        jobs = [_get(kube, JOB, ctx.namespace, names.learner_slice_job(s)) for s in range(slices)]
        learner = observe_indexed_jobs(jobs, learner_shape(ctx.spec.learner).hosts)
    if not ctx.streams:
        return Children(learner=learner, actors=None, buffer=None)
    return Children(
        learner=learner,
        actors=observe_deployment(_get(kube, DEPLOYMENT, ctx.namespace, names.actors)),
        buffer=observe_deployment(_get(kube, DEPLOYMENT, ctx.namespace, names.buffer)),
    )


def heal_children(kube: Kube, ctx: JobContext, children: Children, logger: logging.Logger | logging.LoggerAdapter[Any]) -> list[str]:
    """Recreate what should exist and does not (deleted by hand, or a learner gone after resume);
    "Kind/name" of what it created."""
    missing_parts = (children.actors is not None and not children.actors.exists) or (
        children.buffer is not None and not children.buffer.exists
    )
    if missing_parts or (not ctx.spec.suspend and not children.learner.exists):
        return apply_children(kube, ctx, patch_existing=False, logger=logger)
    return []


@dataclass(frozen=True)
class BufferReading:
    """One look at the buffer: its Stats (or why not) and what they mean for enforcement."""

    stats: StatsSnapshot | None = None
    error: str | None = None
    window: StalenessWindow | None = None
    exceeded: bool | None = None
    starved: bool | None = None
    overproducing: bool = False


def read_buffer(runtime: Runtime, ctx: JobContext, previous: StatsSnapshot | None) -> BufferReading:
    """Stats over gRPC with the job's token; the staleness window is relative to ``previous``."""
    if not ctx.streams:
        return BufferReading()
    secret, key = ctx.token_secret
    address = runtime.settings.buffer_address(ctx.name, ctx.namespace, ctx.buffer_port)
    try:
        stats = runtime.stats.read(address, runtime.token(ctx.namespace, secret, key))
    except StatsUnavailable as exc:
        if exc.auth:
            runtime.forget_token(ctx.namespace, secret, key)
        return BufferReading(error=str(exc))
    window = staleness_window(previous, stats)
    return BufferReading(
        stats=stats,
        window=window,
        exceeded=staleness_exceeded(window, ctx.spec.buffer.max_staleness, ctx.spec.buffer.sample_order),
        overproducing=overproducing(window, ctx.spec.buffer.max_staleness, ctx.spec.buffer.sample_order),
        starved=learner_starved(stats, runtime.settings.starved_duty_cycle),
    )


def apply_live_buffer_settings(runtime: Runtime, ctx: JobContext, stats: StatsSnapshot) -> str:
    """Configure the buffer's live settings (``LIVE_BUFFER_FIELDS``) where Stats shows them behind
    the spec; says what changed ("" when nothing differs). ``StatsUnavailable`` if the call fails."""
    changes = live_buffer_changes(ctx.spec, stats)
    if not changes:
        return ""
    secret, key = ctx.token_secret
    address = runtime.settings.buffer_address(ctx.name, ctx.namespace, ctx.buffer_port)
    runtime.stats.configure(address, runtime.token(ctx.namespace, secret, key), changes)
    described = ", ".join(f"{LIVE_SPEC_NAMES[k]} {getattr(stats, k)} -> {v}" for k, v in changes.items())
    return f"applied to the buffer live, without a restart: {described}"


def apply_admission(kube: Kube, ctx: JobContext) -> None:
    """Write ``ctx.admission_scale`` to the buffer's control ConfigMap."""
    kube.patch(CONFIGMAP, ctx.namespace, ctx.names.buffer_control, {"data": build_buffer_control_configmap(ctx)["data"]})


def sync_actor_replicas(kube: Kube, ctx: JobContext, actors: DeploymentObservation | None, replicas: int) -> None:
    """Level-based: the actor Deployment has the operator's replica count, whoever changed it."""
    if actors is not None and actors.exists and actors.replicas != replicas:
        kube.patch(DEPLOYMENT, ctx.namespace, ctx.names.actors, {"spec": {"replicas": replicas}})


def reap_pods(kube: Kube, namespace: str, names: list[str]) -> list[str]:
    """Delete these pods (zombie sandboxes, or a deleted job's last ones); those actually deleted."""
    deleted = []
    for name in names:
        try:
            kube.delete(POD, namespace, name)
        except NotFound:
            continue  # gone already
        deleted.append(name)
    return deleted
