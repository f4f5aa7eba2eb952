"""The sandbox pod manifest: labels and heartbeat the operator reaps by, and a locked-down pod."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import kubernetes_validate
import pytest

from stoker import labels
from stoker.actor.pods import sandbox_pod_manifest, sandbox_pod_name


def manifest() -> dict:  # type: ignore[type-arg]
    return sandbox_pod_manifest(
        name=sandbox_pod_name("demo", "abcd1234"),
        namespace="rl",
        job="demo",
        actor_pod="demo-actor-0",
        image="ghcr.io/example/stoker:1.0",
        cpu_seconds=60,
        memory_mb=512,
        heartbeat_ttl_seconds=120,
        heartbeat="2026-01-02T03:04:05.000000Z",
    )


def test_labels_and_heartbeat_annotation() -> None:
    meta = manifest()["metadata"]
    assert meta["name"] == "demo-sbx-abcd1234" and meta["namespace"] == "rl"
    assert meta["labels"][labels.JOB_LABEL] == "demo"
    assert meta["labels"][labels.ROLE_LABEL] == "sandbox"
    assert meta["labels"][labels.ACTOR_LABEL] == "demo-actor-0"
    beat = labels.parse_rfc3339(meta["annotations"][labels.HEARTBEAT_ANNOTATION])
    assert beat == datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert labels.sandbox_selector("demo", "demo-actor-0") == (
        "stoker.dev/role=sandbox,stoker.dev/job=demo,stoker.dev/actor=demo-actor-0"
    )


def test_pod_is_locked_down_and_limited() -> None:
    spec = manifest()["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    [container] = spec["containers"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
    assert security["capabilities"]["drop"] == ["ALL"] and security["readOnlyRootFilesystem"] is True
    assert container["resources"]["limits"]["memory"] == "512Mi" and container["resources"]["limits"]["cpu"] == "1"
    assert "--cpu-seconds=60" in container["args"] and "--memory-mb=512" in container["args"]
    assert "--idle-exit-seconds=120" in container["args"]  # self-reaps if the actor stops heartbeating
    assert container["command"][-1] == "stoker.actor.sandbox_server"


def test_manifest_validates_against_the_kubernetes_schema() -> None:
    kubernetes_validate.validate(manifest(), "1.30", strict=True)


@pytest.mark.parametrize("job", ["x", "a" * 63])
def test_pod_names_are_dns_labels(job: str) -> None:
    name = sandbox_pod_name(job)
    assert len(name) <= 63 and name.startswith(job[:10]) and "-sbx-" in name


def test_rfc3339_round_trip() -> None:
    now = datetime.now(timezone.utc)
    text = labels.rfc3339(now)
    assert text.endswith("Z") and abs(labels.parse_rfc3339(text) - now) < timedelta(microseconds=1)


def test_the_pod_is_the_boundary_so_its_judge_runs_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """RuntimeDefault seccomp forbids bwrap's user namespaces in a pod: without the manifest's
    request for the rlimits layer every test run in a sandbox pod would refuse to start."""
    from stoker.actor import isolation

    [container] = manifest()["spec"]["containers"]
    monkeypatch.delenv(isolation.ENV, raising=False)
    for item in container["env"]:
        monkeypatch.setenv(item["name"], item["value"])
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap, as in the actor image
    isolation.isolation.cache_clear()  # type: ignore[attr-defined]
    try:
        assert isolation.isolation() == isolation.FALLBACK
    finally:
        isolation.isolation.cache_clear()  # type: ignore[attr-defined]
