"""The CRD is generated from the spec, committed, structural and valid for Kubernetes."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from stoker.crd import CRD_PATH, build_crd, render_crd
from stoker.status import CONDITION_TYPES, Condition

K8S_VERSION = "1.35"


def _walk(node: Any, path: str = ""):  # type: ignore[no-untyped-def]
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}[{index}]")


def test_committed_crd_matches_the_spec() -> None:
    assert CRD_PATH.read_text() == render_crd(), "crds/rljob.yaml is stale: run `stoker crd --write`"


def test_crd_validates_against_the_kubernetes_schema() -> None:
    kubernetes_validate.validate(build_crd(), K8S_VERSION, strict=True)


def test_schema_is_structural() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert not {"$ref", "anyOf", "allOf", "oneOf", "$defs", "title", "const"} & node.keys(), path
        if "properties" in node:
            assert node.get("type") == "object", path


def test_cross_field_rules_are_cel_and_topology_is_immutable() -> None:
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    actor_rules = [r["rule"] for r in spec["actors"]["x-kubernetes-validations"]]
    assert "self.minReplicas <= self.maxReplicas" in actor_rules
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root_messages = [r["message"] for r in root["x-kubernetes-validations"]]
    # At the root, so a job created without a learner block cannot switch them later
    # (tests/core/test_cel.py runs them).
    for field in ("mode", "learner.accelerator", "learner.numSlices"):
        assert f"spec.{field} is immutable" in root_messages
    assert "spec.learner.topology is immutable once set" in root_messages


def test_status_subresource_printer_columns_and_conditions() -> None:
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Version"] == ".status.policyVersion"
    assert columns["Staleness"].startswith(".status.staleness")
    assert columns["Duty"] == ".status.learnerDutyCycle"
    assert columns["Actors"].startswith(".status.actors")
    assert columns["Age"] == ".metadata.creationTimestamp"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert {"type", "status", "reason", "lastTransitionTime"} <= set(conditions["items"]["required"])
    # metav1.Condition's own limits, so a condition the API server stores is one any client reads.
    fields = conditions["items"]["properties"]
    assert fields["lastTransitionTime"]["format"] == "date-time"
    assert (fields["type"]["maxLength"], fields["reason"]["maxLength"], fields["message"]["maxLength"]) == (316, 1024, 32768)
    # metav1's type pattern (CamelCase, or prefixed by a DNS subdomain), applied to every type we write.
    type_pattern = re.compile(fields["type"]["pattern"])
    assert all(type_pattern.match(t) for t in CONDITION_TYPES)
    assert type_pattern.match("stoker.dev/LearnerReady")
    assert not any(type_pattern.match(t) for t in ("Learner Ready", "-Ready", "Ready!", "Stoker.dev/Ready", "a/"))
    for bad in ("Learner Ready", "x" * 317, ""):
        with pytest.raises(ValidationError, match="type"):
            Condition(type=bad, status="True", reason="Ok", last_transition_time="2026-01-01T00:00:00Z")
    assert "StalenessExceeded" in CONDITION_TYPES and "LearnerStarved" in CONDITION_TYPES


def test_rendered_file_is_plain_yaml() -> None:
    assert yaml.safe_load(CRD_PATH.read_text())["metadata"]["name"] == "rljobs.stoker.dev"
