"""examples/kueue validates against Kueue's own CRD schemas (v1beta2, the storage version;
v1beta1 is deprecated), strictly: an unknown field is an error, as `kubectl apply
--validate=strict` makes it. The schemas are Kueue's, vendored in schemas/kueue-v1beta2.json."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = json.loads((Path(__file__).parent / "schemas" / "kueue-v1beta2.json").read_text())
EXAMPLE = REPO / "examples" / "kueue" / "tpu-v6e-queues.yaml"


def strict(schema: Any) -> Any:
    """Unknown fields refused wherever the schema lists the known ones."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema and not schema.get(
                "x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


def validator(kind: str) -> jsonschema.Draft4Validator:
    schema = strict(copy.deepcopy(SCHEMAS[kind]))
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft4Validator(schema)


DOCS = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


@pytest.mark.parametrize("doc", DOCS, ids=[d["kind"] for d in DOCS])
def test_kueue_objects_are_valid_v1beta2(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    errors = [f"{list(e.path)}: {e.message}" for e in validator(doc["kind"]).iter_errors(doc)]
    assert not errors, errors


def test_the_check_refuses_a_misspelt_field() -> None:
    queue = copy.deepcopy(next(d for d in DOCS if d["kind"] == "LocalQueue"))
    queue["spec"]["clusterQueu"] = queue["spec"].pop("clusterQueue")
    assert list(validator("LocalQueue").iter_errors(queue))
