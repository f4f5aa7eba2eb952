"""How the operator reads spec edits (kopf diffs): which ones reset the actor replica target."""

from __future__ import annotations

from typing import Any

import pytest

from stoker.operator.handlers import replicas_changed


@pytest.mark.parametrize(
    ("diff", "changed"),
    [
        ([("change", ("spec", "actors", "replicas"), 2, 5)], True),
        # A job created without an actors block, given one later: kopf reports the block.
        ([("add", ("spec", "actors"), None, {"replicas": 5})], True),
        ([("add", ("spec",), None, {"actors": {"replicas": 5}})], True),
        ([("change", ("spec", "actors"), {"replicas": 2}, {"replicas": 3, "image": "x"})], True),
        ([("remove", ("spec", "actors"), {"replicas": 5}, None)], True),
        ([("change", ("spec", "actors"), {"replicas": 2}, {"replicas": 2, "image": "x"})], False),
        ([("change", ("spec", "actors", "maxReplicas"), 8, 9)], False),
        ([("add", ("spec", "buffer"), None, {"maxStaleness": 2})], False),
        ([], False),
        (None, False),
    ],
)
def test_replica_edits_are_seen_however_kopf_reports_them(diff: Any, changed: bool) -> None:
    assert replicas_changed(diff) is changed
