"""How the operator takes spec edits: which reset the actor replica target (kopf diffs), and
which restart which pods."""

from __future__ import annotations

import os
from typing import Any

import pytest

from stoker.actor.settings import ActorSettings
from stoker.buffer.settings import BufferSettings
from stoker.operator.job_targets import replicas_changed
from stoker.operator.rollout import (
    ACTOR_CONFIG_FIELDS,
    ACTOR_HASH_IGNORES,
    BUFFER_CONFIG_FIELDS,
    LIVE_BUFFER_FIELDS,
    config_hash,
)
from stoker.spec import RLJobSpec


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


# ------------------------------------------------------------------ which edits roll which pods

# One edit of every area of the spec (each a valid job on its own).
EDITS: dict[str, dict[str, Any]] = {
    "learningRate": {"algorithm": {"learningRate": 0.01}},
    "algorithm": {"algorithm": {"name": "ppo"}},
    "maxSteps": {"learner": {"maxSteps": 9}},
    "checkpoint": {"learner": {"checkpoint": {"intervalSteps": 7}}},
    "maxRestarts": {"learner": {"maxRestarts": 1}},
    "batchGroups": {"learner": {"batchGroups": 2}},
    "sequenceBuckets": {"learner": {"sequenceBuckets": [64, 128]}},
    "maxStaleness": {"buffer": {"maxStaleness": 2}},
    "groupSize": {"buffer": {"groupSize": 4}},
    "capacity": {"buffer": {"capacity": 100}},
    "temperature": {"actors": {"sampling": {"temperature": 0.5}}},
    "concurrency": {"actors": {"concurrency": 2}},
    "replicas": {"actors": {"replicas": 7, "maxReplicas": 9}},
    "suspend": {"suspend": True},
    "maxTurns": {"environment": {"maxTurns": 3}},
    "seed": {"seed": 5},
}
# What the users see: which pods each edit restarts.
ROLLS = {
    "learningRate": set(), "algorithm": set(), "maxSteps": set(), "checkpoint": set(), "maxRestarts": set(),
    "batchGroups": {"buffer"}, "sequenceBuckets": {"actors"}, "maxStaleness": set(),  # the buffer takes it live
    "groupSize": {"actors", "buffer"}, "capacity": set(), "temperature": {"actors"}, "concurrency": {"actors"},
    "replicas": set(), "suspend": set(), "maxTurns": {"actors"}, "seed": {"actors"},
}


def actor_hash(spec: RLJobSpec) -> str:
    return config_hash(spec, include=ACTOR_CONFIG_FIELDS, ignore=ACTOR_HASH_IGNORES)


def buffer_hash(spec: RLJobSpec) -> str:
    return config_hash(spec, include=BUFFER_CONFIG_FIELDS, ignore=LIVE_BUFFER_FIELDS)


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_rolls_only_the_pods_that_read_it(edit: str) -> None:
    base, edited = RLJobSpec(), RLJobSpec.model_validate(EDITS[edit])
    rolled = {name for name, digest in (("actors", actor_hash), ("buffer", buffer_hash)) if digest(base) != digest(edited)}
    assert rolled == ROLLS[edit]


@pytest.mark.parametrize("edit", EDITS)
def test_the_hashed_fields_are_all_the_components_read(edit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Derived, not listed: an edit that leaves a component's hash alone leaves the settings it
    builds from the spec alone too (so a running pod would not behave differently after a roll)."""
    monkeypatch.setattr(os, "environ", {})
    base, edited = RLJobSpec(), RLJobSpec.model_validate(EDITS[edit])
    if actor_hash(base) == actor_hash(edited):
        kwargs = {"actor_id": "a", "job": "lake", "namespace": "ns", "pod_name": "p"}
        assert ActorSettings.from_spec(base, **kwargs) == ActorSettings.from_spec(edited, **kwargs)
    if buffer_hash(base) == buffer_hash(edited):  # the live fields are the settings Configure changes
        live = {"capacity": edited.buffer.capacity, "max_staleness": edited.buffer.max_staleness}
        assert BufferSettings.from_spec(base, environ={}, **live) == BufferSettings.from_spec(edited, environ={})
