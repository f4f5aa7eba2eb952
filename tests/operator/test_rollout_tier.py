"""One look at the rollout tier with the timer's own code (an in-memory API server, no servers
answering): a suspended or finished job scales its servers to 0 and keeps the target for later."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

from stoker.operator.kube import Conflict, NotFound, Resource, resource_of
from stoker.operator.manifests import JobContext
from stoker.operator.rollout_tier import look_after_rollout
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
