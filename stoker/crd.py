"""Generate the RLJob CustomResourceDefinition from the typed spec (``stoker crd``).

pydantic emits JSON Schema (``$ref``s, ``anyOf`` for optionals, titles); Kubernetes wants a
*structural* OpenAPI v3 schema (everything inlined, ``nullable`` instead of ``anyOf null``, no
``$ref``). ``structural`` performs that translation; the CEL rules and the status schema are
attached afterwards. ``crds/rljob.yaml`` is this module's output, committed and checked by a test.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from stoker import spec as rlspec
from stoker.status import RLJobStatus

CRD_PATH = Path(__file__).resolve().parent.parent / "crds" / "rljob.yaml"

_DROP_KEYS = {"title", "$defs", "examples"}


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Translate a pydantic JSON Schema node into a structural OpenAPI v3 schema node."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs)
    if "anyOf" in schema:
        options = [o for o in schema["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(schema["anyOf"])
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {len(options)} types structurally: {schema}")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        translated = structural({**options[0], **rest}, defs)
        if nullable:
            translated["nullable"] = True
        return translated
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROP_KEYS:
            continue
        if key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = structural(value, defs)
        elif key == "const":
            out["enum"] = [value]
        elif key == "additionalProperties" and value is False:
            continue  # structural schemas prune unknown fields already
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            # JSON Schema 2020 puts the bound here; OpenAPI v3.0 wants the bound plus a flag.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "default" and value is None:
            continue  # an unset optional is simply absent
        else:
            out[key] = copy.deepcopy(value)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "properties" in out:
        out.setdefault("type", "object")
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _attach_cel(spec_schema: dict[str, Any]) -> None:
    for path, rules in rlspec.CEL_RULES.items():
        node = spec_schema
        for part in path:
            node = node["properties"][part]
        node["x-kubernetes-validations"] = rules


def spec_schema() -> dict[str, Any]:
    raw = rlspec.RLJobSpec.model_json_schema(by_alias=True, mode="validation")
    schema = structural(raw)
    _attach_cel(schema)
    return schema


# metav1.Condition's own validation (k8s.io/apimachinery/pkg/apis/meta/v1/types.go markers).
CONDITION_LIMITS: dict[str, dict[str, Any]] = {
    "type": {"minLength": 1, "maxLength": 316},
    "reason": {"minLength": 1, "maxLength": 1024},
    "message": {"maxLength": 32768},
    "observedGeneration": {"minimum": 0},
    "lastTransitionTime": {"format": "date-time"},
}


def status_schema() -> dict[str, Any]:
    schema = structural(RLJobStatus.model_json_schema(by_alias=True, mode="serialization"))
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    for name, limits in CONDITION_LIMITS.items():
        conditions["items"]["properties"][name].update(limits)
    return schema


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Version", "type": "integer", "jsonPath": ".status.policyVersion", "description": "Policy version"},
    {"name": "Staleness", "type": "integer", "jsonPath": ".status.staleness.max", "description": "Max staleness"},
    {"name": "Duty", "type": "number", "jsonPath": ".status.learnerDutyCycle", "description": "Learner duty cycle"},
    {"name": "Actors", "type": "string", "jsonPath": ".status.actors.summary", "description": "Ready/desired"},
    {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.summary", "description": "Rollout servers ready/desired"},
    {"name": "Tok/s", "type": "number", "jsonPath": ".status.rollout.tokensPerSecond", "description": "Rollout tokens/s"},
    {"name": "Fill", "type": "number", "jsonPath": ".status.bufferFill", "priority": 1},
    {"name": "Eval", "type": "number", "jsonPath": ".status.evaluation.successRate", "description": "Held-out success (greedy)", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{rlspec.PLURAL}.{rlspec.GROUP}"},
        "spec": {
            "group": rlspec.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": rlspec.KIND,
                "listKind": f"{rlspec.KIND}List",
                "plural": rlspec.PLURAL,
                "singular": rlspec.SINGULAR,
                "shortNames": rlspec.SHORT_NAMES,
                "categories": ["stoker"],
            },
            "versions": [
                {
                    "name": rlspec.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            # Rules needing metadata.name or spanning absent objects (immutability).
                            "x-kubernetes-validations": rlspec.ROOT_CEL_RULES,
                            "description": "An asynchronous agentic RL job: actors, buffer and learner.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    header = "# Generated by `stoker crd` from stoker/spec.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)
