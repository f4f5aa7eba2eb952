"""One look at the rollout tier with the timer's own code (an in-memory API server, no servers
answering): a suspended or finished job scales its servers to 0 and keeps the target for later;
which pods are read for Stats (host 0 of a multi-host server, once all its hosts are ready)."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

from stoker.labels import JOB_LABEL, ROLE_LABEL
from stoker.operator.kube import Conflict, NotFound, Resource, resource_of
from stoker.operator.learner_workload import COMPLETION_INDEX_LABEL
from stoker.operator.manifests import JobContext
from stoker.operator.rollout_tier import RolloutPod, index_rollout_pods, look_after_rollout, server_addresses
from stoker.operator.rollout_workload import SERVER_LABEL
from stoker.operator.rolloutstats import RolloutStatsReader
from stoker.operator.settings import OperatorSettings
from stoker.spec import RLJobSpec


class MemoryKube:
    """create/get/patch/delete/list on dicts, keyed by (plural, name)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        key = (resource_of(obj["apiVersion"], obj["kind"]).plural, obj["metadata"]["name"])
        if key in self.objects:
            raise Conflict("exists")
        self.objects[key] = obj
        return obj

    def get(self, res: Resource, namespace: str, name: str) -> dict[str, Any]:
        if (res.plural, name) not in self.objects:
            raise NotFound(name)
        return self.objects[(res.plural, name)]

    def patch(self, res: Resource, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        obj = self.objects[(res.plural, name)]
        obj["spec"].update(patch.get("spec", {}))
        return obj

    def delete(self, res: Resource, namespace: str, name: str, **_: Any) -> None:
        if self.objects.pop((res.plural, name), None) is None:
            raise NotFound(name)

    def list(self, res: Resource, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        return [o for (plural, _), o in self.objects.items() if plural == res.plural]


def look(kube: MemoryKube, spec: dict[str, Any], *, target: int, running: bool) -> Any:
    ctx = JobContext("gen", "ns", "uid", RLJobSpec.model_validate(spec), OperatorSettings(), actor_replicas=2,
                     rollout_replicas=target)
    return look_after_rollout(kube, RolloutStatsReader(timeout=0.1), OperatorSettings(), ctx, target=target, pods=[],  # type: ignore[arg-type]
                              memo={}, now=datetime.now(timezone.utc), starved=None, running=running,
                              logger=logging.getLogger("test"))


def test_suspended_servers_go_to_zero_and_the_target_stays() -> None:
    kube = MemoryKube()
    single = {"rollout": {"replicas": 3, "maxReplicas": 4}}
    assert look(kube, single, target=3, running=True).target == 3
    assert kube.objects[("deployments", "gen-rollout")]["spec"]["replicas"] == 3
    assert look(kube, single, target=3, running=False).target == 3  # what status.rollout.desired keeps
    assert kube.objects[("deployments", "gen-rollout")]["spec"]["replicas"] == 0
    assert look(kube, single, target=3, running=True).target == 3
    assert kube.objects[("deployments", "gen-rollout")]["spec"]["replicas"] == 3
    # Multi-host servers: their JobSets go while suspended, and come back.
    tpu = {"rollout": {"accelerator": "tpu-v5p-slice", "topology": "2x2x4", "replicas": 2}}
    look(kube, tpu, target=2, running=True)
    jobsets = lambda: sorted(n for p, n in kube.objects if p == "jobsets")  # noqa: E731
    assert jobsets() == ["gen-rollout-0", "gen-rollout-1"] and ("deployments", "gen-rollout") not in kube.objects
    assert look(kube, tpu, target=2, running=False).target == 2 and jobsets() == []
    look(kube, tpu, target=2, running=True)
    assert jobsets() == ["gen-rollout-0", "gen-rollout-1"]


def indexed(name: str, ip: str, *, ready: bool = True, server: str | None = None, host: int | None = None,
            where: str = "labels", deleting: bool = False) -> RolloutPod:
    """What the operator's pod index keeps of a rollout pod, built through the index function."""
    labels = {JOB_LABEL: "gen", ROLE_LABEL: "rollout", **({SERVER_LABEL: server} if server is not None else {})}
    annotations: dict[str, str] = {}
    if host is not None:
        (labels if where == "labels" else annotations)[COMPLETION_INDEX_LABEL] = str(host)
    status = {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    meta = {"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {}
    [(key, pod)] = index_rollout_pods(name, labels, annotations, status, meta, "ns").items()
    assert key == ("ns", "gen")
    return pod


def test_single_host_servers_are_every_ready_pod() -> None:
    pods = [indexed("a", "10.0.0.2"), indexed("b", "10.0.0.3", ready=False), indexed("c", "")]
    assert server_addresses(pods, 50051) == ["10.0.0.2:50051"]


def test_a_multi_host_server_is_read_at_host_0_once_every_host_is_ready() -> None:
    hosts = [indexed(f"s0-{i}", f"10.0.1.{i}", server="0", host=i) for i in range(4)]
    # host 0 alone answers Stats; the followers (gRPC health only) are never addressed
    assert server_addresses(hosts, 50051, hosts=4) == ["10.0.1.0:50051"]
    # a server missing a host cannot generate: not read, so not counted as answering
    not_yet = hosts[:3] + [indexed("s0-3", "10.0.1.3", server="0", host=3, ready=False)]
    assert server_addresses(not_yet, 50051, hosts=4) == []
    # a terminating host of a restarting slice does not count, nor does a duplicate of an index
    going = hosts[:3] + [indexed("s0-3-old", "10.0.1.9", server="0", host=3, deleting=True),
                         indexed("s0-2-new", "10.0.1.8", server="0", host=2)]
    assert server_addresses(going, 50051, hosts=4) == []
    # two servers, each with its own hosts; the completion index read from the annotation too
    other = [indexed(f"s1-{i}", f"10.0.2.{i}", server="1", host=i, where="annotations") for i in range(4)]
    assert server_addresses(hosts + other, 50051, hosts=4) == ["10.0.1.0:50051", "10.0.2.0:50051"]
    assert not indexed("f", "10.0.2.5", server="1", host=1, where="annotations").leader
