"""pods -> zombie list: orphaned or silent sandbox pods, never anything else."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.operator.zombies import PodRecord, find_zombies, job_sandboxes, pod_record

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
TTL = 120.0


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def test_cases() -> None:
    pods = [
        PodRecord("actor-a", "actor"),
        PodRecord("learner-0", "learner"),
        PodRecord("sb-fresh", "sandbox", actor="actor-a", heartbeat=ago(10)),
        PodRecord("sb-colocated", "sandbox", actor="learner-0", heartbeat=ago(10)),
        PodRecord("sb-orphan", "sandbox", actor="actor-gone", heartbeat=ago(1)),
        PodRecord("sb-silent", "sandbox", actor="actor-a", heartbeat=ago(TTL + 1)),
        PodRecord("sb-new", "sandbox", actor="actor-a", created=ago(5)),
        PodRecord("sb-never-beat", "sandbox", actor="actor-a", created=ago(TTL + 60)),
        PodRecord("sb-anonymous", "sandbox"),
        PodRecord("sb-going", "sandbox", actor="actor-gone", deleting=True),
    ]
    zombies = {z.name: z.reason for z in find_zombies(pods, NOW, TTL)}
    assert set(zombies) == {"sb-orphan", "sb-silent", "sb-never-beat", "sb-anonymous"}
    assert "actor-gone is gone" in zombies["sb-orphan"]
    assert "no heartbeat for 121s" in zombies["sb-silent"]


def test_actor_being_deleted_orphans_its_sandboxes() -> None:
    pods = [PodRecord("actor-a", "actor", deleting=True), PodRecord("sb", "sandbox", actor="actor-a", heartbeat=NOW)]
    assert [z.name for z in find_zombies(pods, NOW, TTL)] == ["sb"]


def test_pod_record_reads_labels_and_annotations() -> None:
    record = pod_record(
        "sb",
        {"stoker.dev/role": "sandbox", "stoker.dev/job": "j"},
        {"stoker.dev/actor": "actor-a", "stoker.dev/heartbeat": "2026-01-01T11:59:00.000000Z"},
        {"creationTimestamp": "2026-01-01T11:00:00Z"},
    )
    assert record.actor == "actor-a" and record.role == "sandbox"
    assert record.heartbeat == ago(60) and record.created == ago(3600)
    garbled = pod_record("sb", {"stoker.dev/role": "sandbox"}, {"stoker.dev/heartbeat": "yesterday"}, {})
    assert garbled.heartbeat is None  # unparsable heartbeats count as absent, not as a crash


names = st.sampled_from([f"p{i}" for i in range(8)])
records = st.builds(
    PodRecord,
    name=names,
    role=st.sampled_from(["actor", "learner", "sandbox", "buffer", ""]),
    actor=st.none() | names,
    heartbeat=st.none() | st.floats(0, 1000).map(ago),
    created=st.none() | st.floats(0, 1000).map(ago),
    deleting=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(records, max_size=12, unique_by=lambda p: p.name), st.floats(1, 500))
def test_only_reapable_sandboxes_are_reaped(pods: list[PodRecord], ttl: float) -> None:
    zombies = {z.name for z in find_zombies(pods, NOW, ttl)}
    by_name = {p.name: p for p in pods}
    owners = {p.name for p in pods if p.role in ("actor", "learner") and not p.deleting}
    for pod in pods:
        healthy = (
            pod.actor in owners
            and (seen := pod.heartbeat or pod.created) is not None
            and (NOW - seen).total_seconds() <= ttl
        )
        if pod.role != "sandbox" or pod.deleting:
            assert pod.name not in zombies
        elif healthy:
            assert pod.name not in zombies
        elif pod.actor not in owners:
            assert pod.name in zombies
    assert all(by_name[name].role == "sandbox" for name in zombies)


def test_sandbox_pods_are_owned_by_their_actor_pod(monkeypatch: Any) -> None:
    """The operator gives actors their pod's uid; the sandbox pods they create name that pod as
    owner, so the garbage collector deletes them with it, operator or not."""
    from stoker.actor.pods import sandbox_pod_manifest
    from stoker.actor.settings import ActorSettings
    from stoker.operator.manifests import JobContext, build_actor_deployment
    from stoker.operator.settings import OperatorSettings
    from stoker.spec import RLJobSpec

    spec = RLJobSpec.model_validate({"environment": {"sandbox": {"kind": "pod"}}})
    deployment = build_actor_deployment(JobContext("lake", "research", "uid-1", spec, OperatorSettings(), actor_replicas=1))
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"

    monkeypatch.setenv("POD_UID", "actor-uid-7")  # what the kubelet resolves it to
    settings = ActorSettings.from_spec(spec, actor_id="a", job="lake", namespace="research", pod_name="lake-actor-x")
    pod = settings.pod
    assert pod is not None
    manifest = sandbox_pod_manifest(name="lake-sbx-1", namespace=pod.namespace, job=pod.job, actor_pod=pod.actor_pod,
                                    image=pod.image, cpu_seconds=10, memory_mb=64, heartbeat_ttl_seconds=60,
                                    actor_pod_uid=pod.actor_pod_uid)
    assert manifest["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "lake-actor-x", "uid": "actor-uid-7"}]


def test_job_sandboxes_keeps_only_this_jobs_live_sandboxes() -> None:
    """Whatever the server returns (kmock ignores selectors), only the job's own sandboxes go."""
    def pod(name: str, job: str, role: str, deleting: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "labels": {"stoker.dev/job": job, "stoker.dev/role": role}}
        if deleting:
            meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
        return {"metadata": meta}

    pods = [pod("a", "lake", "sandbox"), pod("b", "lake", "actor"), pod("c", "other", "sandbox"),
            pod("d", "lake", "sandbox", deleting=True), {"metadata": {"name": "e"}}]
    assert job_sandboxes(pods, "lake") == ["a"]

