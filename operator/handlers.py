"""kopf handlers: thin glue between events/timers and the pure builders and status logic.

The per-job handlers live here; kopf's own setup (its settings and login) in ``kopf_setup``.
``register(registry, settings)`` wires them all into a kopf registry, so intervals come from
``OperatorSettings`` and tests run the real handlers against an emulated API server.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import kopf

from stoker.labels import JOB_LABEL, ROLE_LABEL, ROLE_SANDBOX
from stoker.operator import kube as kubeapi
from stoker.operator.bufferstats import StatsUnavailable
from stoker.operator.control import Action, actors_diagnosis, decide
from stoker.operator.job_targets import actor_target, job_context
from stoker.operator.jobstatus import Observed, build_status, failed_status
from stoker.operator.kopf_errors import kopf_error, refused_child_error
from stoker.operator.kopf_setup import configure, login
from stoker.operator.learner_workload import ephemeral_checkpoints
from stoker.operator.lifecycle import children_created, resumed, resuming, rollout_changed, suspending
from stoker.operator.reconcile import (
    POD,
    InvalidJob,
    Runtime,
    apply_admission,
    apply_children,
    apply_live_buffer_settings,
    applied_spec,
    heal_children,
    observe_children,
    parse_spec,
    read_buffer,
    reap_pods,
    remove_learner,
    sync_actor_replicas,
)
from stoker.operator.restart_ledger import read_ledger, track_restarts
from stoker.operator.rollout_tier import (
    ROLLOUT_POD_INDEX,
    index_rollout_pods,
    look_after_rollout,
    rollout_blocked,
    rollout_target,
    seeded_status,
)
from stoker.operator.naming import ROLE_ROLLOUT
from stoker.operator.settings import OperatorSettings
from stoker.operator.zombies import PodRecord, find_zombies, job_sandboxes, pod_record
from stoker.spec import GROUP, PLURAL, VERSION, RLJobSpec

Logger = logging.Logger | logging.LoggerAdapter[Any]

POD_INDEX = "stoker_pods"


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _applied(runtime: Runtime, namespace: str, name: str) -> RLJobSpec | None:
    try:
        return applied_spec(runtime.kube, namespace, name)
    except kubeapi.ApiError:
        return None  # unreadable now: treated as never applied; the next look tries again


def _runtime(memo: Any) -> Runtime:
    runtime: Runtime = memo["runtime"]
    return runtime


def _post(body: kopf.Body, action: Action | None) -> None:
    if action is not None:
        kopf.event(body, type=action.type, reason=action.reason, message=action.message)


def one_writer(handler: Callable[..., None]) -> Callable[..., None]:
    """Run ``handler`` holding its job's writer lock: the update handler and the timer never write
    one job's children at the same time.

    kopf runs both in threads over one live body, so a look that read the spec before an edit
    arrived would go on writing for the old spec after the update handler applied the new one
    (a resume undone: docs/operator.md, "One writer per job"). With the lock, a look in progress
    finishes first and the edit is applied after it; an edit waits at most one look (bounded by
    the Stats timeouts)."""

    @functools.wraps(handler)
    def locked(*args: Any, memo: Any, **kwargs: Any) -> None:
        lock: threading.Lock = memo.setdefault("writer_lock", threading.Lock())  # per object: kopf copies memo
        with lock:
            handler(*args, memo=memo, **kwargs)

    return locked


# ---------------------------------------------------------------------------------- handlers


def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    name: str,
    namespace: str | None,
    uid: str,
    meta: kopf.Meta,
    patch: kopf.Patch,
    memo: Any,
    logger: Logger,
    diff: Any = None,
    retry: int = 0,
    **_: Any,
) -> None:
    """on create/resume/update: make the children match the spec (suspend and resume included)."""
    runtime = _runtime(memo)
    namespace = namespace or "default"  # RLJobs are namespaced; kopf types it optional
    generation = meta.get("generation")
    try:
        parsed = parse_spec(name, spec)
    except InvalidJob as exc:
        kopf.warn(body, reason=exc.reason, message=str(exc))
        if _applied(runtime, namespace, name) is not None:
            # A refused edit of a running job: the children keep the last applied spec, and the
            # timer keeps observing them (SpecAccepted=False says why).
            memo["reconciled"] = True
        else:
            patch.status.update(failed_status(str(exc), exc.reason, dict(status), _now(), generation))
        raise kopf.PermanentError(str(exc)) from None
    target = actor_target(parsed, dict(status), diff)
    servers = rollout_target(parsed, dict(status))
    scale = float(status.get("admissionScale") or 1.0)
    try:
        ctx = job_context(runtime, name, namespace, uid, parsed, target, scale, servers)
        created = apply_children(runtime.kube, ctx, patch_existing=True, logger=logger)
        _post(body, children_created(created))
        if any(c.startswith(("JobSet/", "Job/")) for c in created) and ephemeral_checkpoints(ctx):
            kopf.warn(body, reason="EphemeralCheckpoints", message=(
                f"learner.checkpoint.dir {parsed.learner.checkpoint.dir!r} is local to each learner host and is lost "
                "on suspend or restart; use a shared location such as gs://bucket/path"))
        if parsed.suspend and remove_learner(runtime.kube, ctx, jobset_api=ctx.jobset_api):
            _post(body, suspending(parsed))
        elif resumed(diff):
            _post(body, resuming(parsed))
    except kubeapi.ApiError as exc:
        raise refused_child_error(exc, body, status, patch, generation, retry, runtime.settings) from None
    memo["reconciled"] = True
    patch.status["actors"] = {"desired": target, "ready": (status.get("actors") or {}).get("ready", 0),
                              "summary": f"{(status.get('actors') or {}).get('ready', 0)}/{target}"}
    patch.status["admissionScale"] = scale
    if parsed.rollout is not None and ctx.streams:  # the timer scales from this target
        patch.status["rollout"] = seeded_status(parsed.rollout, status, servers)
    patch.status["observedGeneration"] = generation
    if not status.get("phase") or status.get("phase") == "Failed":
        patch.status["phase"] = "Suspended" if parsed.suspend else "Pending"


def index_pods(
    name: str, labels: Mapping[str, str], annotations: Mapping[str, str], meta: kopf.Meta, status: kopf.Status,
    namespace: str | None, **_: Any
) -> Any:
    """Pods of any Stoker job, keyed by (namespace, job): sandboxes and their possible owners, and
    every component's restarts."""
    return {(namespace, labels[JOB_LABEL]): pod_record(name, labels, annotations, meta, status)}


def monitor(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    name: str,
    namespace: str | None,
    uid: str,
    meta: kopf.Meta,
    patch: kopf.Patch,
    memo: Any,
    logger: Logger,
    **kwargs: Any,
) -> None:
    """The level-based loop: heal children, read the buffer, enforce, reap zombies, write status."""
    if not memo.get("reconciled") or meta.get("deletionTimestamp"):
        return  # not reconciled yet (or the spec is invalid), or going: nothing to heal or observe
    runtime = _runtime(memo)
    namespace = namespace or "default"
    settings = runtime.settings
    spec_problem = None
    try:
        parsed = parse_spec(name, spec)
    except InvalidJob as exc:
        applied = _applied(runtime, namespace, name)
        if applied is None:
            return
        parsed, spec_problem = applied, (exc.reason, str(exc))
    now = _now()
    previous = dict(status)
    target = actor_target(parsed, previous, None)
    servers = rollout_target(parsed, previous)
    scale = float(previous.get("admissionScale") or 1.0)
    try:
        ctx = job_context(runtime, name, namespace, uid, parsed, target, scale, servers)
        children = observe_children(runtime.kube, ctx, jobset_api=ctx.jobset_api)
        _post(body, children_created(heal_children(runtime.kube, ctx, children, logger), missing=True))
        reading = read_buffer(runtime, ctx, memo.get("last_stats"))
        if reading.stats is not None:
            memo["last_stats"] = reading.stats
            try:  # live settings: level-based, so a failed call is made again on the next tick
                configured = apply_live_buffer_settings(runtime, ctx, reading.stats)
            except StatsUnavailable as exc:
                logger.warning("buffer settings not applied yet: %s", exc)
            else:
                if configured:
                    kopf.event(body, type="Normal", reason="BufferConfigured", message=configured)

        finished = children.learner.completed or children.learner.failed
        if reading.window is not None and not parsed.suspend and not finished:
            last = memo.get("last_scaled")
            decision = decide(
                actor_target=target,
                admission_scale=scale,
                min_replicas=parsed.actors.min_replicas,
                max_replicas=parsed.actors.max_replicas,
                exceeded=bool(reading.exceeded),
                starved=reading.starved,
                cooled_down=last is None or (now - last).total_seconds() >= settings.scale_cooldown_seconds,
                settings=settings,
                detail=f"max staleness {reading.window.max}, limit {parsed.buffer.max_staleness}",
                overproduced=reading.overproducing,
                actors=actors_diagnosis(reading.stats, parsed, target) if children.actors is not None else None,
            )
            if decision.actor_target != target:
                memo["last_scaled"] = now
            if decision.admission_scale != scale:
                apply_admission(runtime.kube, replace(ctx, admission_scale=decision.admission_scale))
            target, scale = decision.actor_target, decision.admission_scale
            for action in decision.actions:
                kopf.event(body, type=action.type, reason=action.reason, message=action.message)
                runtime.metrics.action(namespace, name, action.reason)

        actor_replicas = 0 if parsed.suspend or finished else target
        sync_actor_replicas(runtime.kube, ctx, children.actors, actor_replicas)
        look = None
        if parsed.rollout is not None or previous.get("rollout"):
            index = kwargs.get(ROLLOUT_POD_INDEX)
            look = look_after_rollout(
                runtime.kube, runtime.rollout_stats, settings, ctx, target=servers,
                pods=index.get((namespace, name), []) if index is not None else [], memo=memo, now=now,
                starved=reading.starved, running=not parsed.suspend and not finished, logger=logger,
            )
            _post(body, rollout_changed(look.done) if look is not None else None)
            for action in look.actions if look is not None else ():
                kopf.event(body, type=action.type, reason=action.reason, message=action.message)
                runtime.metrics.action(namespace, name, action.reason)
        pods = kwargs.get(POD_INDEX)
        reaped = reap_zombies(runtime, body, namespace, name, pods, parsed, now, logger)
    except kubeapi.ApiError as exc:
        raise kopf_error(exc) from None

    # Pods each component should have now: pods beyond them were removed on purpose, not restarted.
    wanted = {"buffer": children.buffer.replicas if children.buffer is not None else 0,
              "actors": min(children.actors.replicas, actor_replicas) if children.actors is not None else 0,
              "rollout": look.target if look is not None and not parsed.suspend and not finished else 0}
    restarts, ledger = track_restarts(
        (pods[(namespace, name)] if (namespace, name) in pods else []) if pods is not None else None,
        read_ledger(previous.get("restartLedger")), jobset_restarts=children.learner.restarts,
        wanted=wanted, now=now, floor=previous.get("restarts") or {})
    observed = Observed(
        spec=parsed,
        generation=meta.get("generation"),
        learner=children.learner,
        actors=children.actors,
        actor_target=target,
        buffer=children.buffer,
        stats=reading.stats,
        stats_error=reading.error,
        window=reading.window,
        exceeded=reading.exceeded,
        starved=reading.starved,
        zombies_reaped=int(previous.get("zombiesReaped") or 0) + reaped,
        admission_scale=scale,
        spec_problem=spec_problem,
        rollout_target=look.target if look is not None else 0,
        rollout_ready=look.observed.ready if look is not None else 0,
        rollout_reading=look.reading if look is not None else None,
        rollout_blocked=rollout_blocked(ctx),
        restarts=restarts,
        restart_ledger=ledger,
    )
    new_status = build_status(observed, previous, now)
    runtime.metrics.observe(namespace, name, new_status)
    if reaped:
        runtime.metrics.reaped(namespace, name, reaped)
    # Write only what changed: an unchanged status costs no API call and no watch event.
    for key, value in new_status.items():
        if previous.get(key) != value:
            patch.status[key] = value
    if previous.get("rollout") and "rollout" not in new_status:
        patch.status["rollout"] = None  # spec.rollout removed: so is its status


def reap_zombies(
    runtime: Runtime,
    body: kopf.Body,
    namespace: str,
    name: str,
    index: Any,
    spec: RLJobSpec,
    now: datetime,
    logger: Logger,
) -> int:
    """Delete this job's zombie sandbox pods; one Event per sweep that reaped any."""
    if index is None or (namespace, name) not in index:
        return 0
    pods: list[PodRecord] = list(index[(namespace, name)])
    zombies = find_zombies(pods, now, spec.environment.sandbox.heartbeat_ttl_seconds)
    deleted = set(reap_pods(runtime.kube, namespace, [z.name for z in zombies]))
    reaped = [z for z in zombies if z.name in deleted]
    if reaped:
        detail = "; ".join(f"{z.name}: {z.reason}" for z in reaped[:5])
        more = f" (+{len(reaped) - 5} more)" if len(reaped) > 5 else ""
        kopf.event(body, type="Normal", reason="ReapedZombieSandboxes", message=f"deleted {len(reaped)} sandbox pods: {detail}{more}")
        logger.info("reaped %d zombie sandbox pods", len(reaped))
    return len(reaped)


def forget(name: str, namespace: str | None, spec: kopf.Spec, memo: Any, logger: Logger, **kwargs: Any) -> None:
    """Deletion: children go by owner references, sandbox pods by theirs (their actor pod); the
    ones still here are deleted now, in case an actor outlives the job for its grace period or
    made a sandbox without an owner. Then cached tokens, channels and series are dropped.

    The pods are listed from the API server, not read from the pod index: a sandbox created just
    before the deletion may not have reached the index yet, and nothing reaps it once the job is
    gone. The index is the fallback when the list fails."""
    runtime = _runtime(memo)
    namespace = namespace or "default"
    try:
        listed = runtime.kube.list(POD, namespace, label_selector=f"{JOB_LABEL}={name},{ROLE_LABEL}={ROLE_SANDBOX}")
        sandboxes = job_sandboxes(listed, name)
    except kubeapi.ApiError as exc:
        logger.warning("could not list the sandbox pods of a deleted job, using the operator's index: %s", exc)
        index = kwargs.get(POD_INDEX)
        records = index[(namespace, name)] if index is not None and (namespace, name) in index else []
        sandboxes = [p.name for p in records if p.role == ROLE_SANDBOX and not p.deleting]
    try:
        deleted = reap_pods(runtime.kube, namespace, sandboxes)
    except kubeapi.ApiError as exc:
        logger.warning("could not delete the sandbox pods of a deleted job: %s", exc)
    else:
        if deleted:
            logger.info("deleted %d sandbox pods of the deleted job", len(deleted))
    port = int((spec.get("buffer") or {}).get("port") or RLJobSpec().buffer.port)
    runtime.stats.forget(runtime.settings.buffer_address(name, namespace, port))
    runtime.forget(namespace, name)
    runtime.metrics.forget(namespace, name)
    runtime.rollout_stats.forget(memo.pop("rollout_addresses", []))
    memo.pop("last_stats", None)


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    """Wire the handlers into ``registry`` with the intervals from ``settings``."""
    rljobs = (GROUP, VERSION, PLURAL)
    kopf.on.startup(registry=registry, id="configure")(configure)
    kopf.on.login(registry=registry, id="login")(login)
    kopf.on.create(*rljobs, registry=registry, id="reconcile")(one_writer(reconcile))
    kopf.on.resume(*rljobs, registry=registry, id="reconcile")(one_writer(reconcile))
    kopf.on.update(*rljobs, registry=registry, id="reconcile")(one_writer(reconcile))
    kopf.on.delete(*rljobs, registry=registry, id="forget", optional=True)(forget)
    kopf.index("", "v1", "pods", registry=registry, id=POD_INDEX, labels={JOB_LABEL: kopf.PRESENT})(index_pods)
    kopf.index("", "v1", "pods", registry=registry, id=ROLLOUT_POD_INDEX,
               labels={JOB_LABEL: kopf.PRESENT, ROLE_LABEL: ROLE_ROLLOUT})(index_rollout_pods)
    kopf.timer(*rljobs, registry=registry, id="monitor", interval=settings.status_interval_seconds, idle=None)(
        one_writer(monitor))
