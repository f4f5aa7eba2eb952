"""The lifecycle Events a job posts (``kubectl describe rljob``): which edits are a resume, however
kopf reports them, and what the messages say for each kind of job."""

from __future__ import annotations

from typing import Any

import pytest

from stoker.operator.lifecycle import MAX_LISTED, children_created, resumed, resuming, rollout_changed, suspending
from stoker.spec import RLJobSpec


@pytest.mark.parametrize(
    ("diff", "lifted"),
    [
        ([("change", ("spec", "suspend"), True, False)], True),
        ([("remove", ("spec", "suspend"), True, None)], True),  # the field deleted
        ([("change", ("spec",), {"suspend": True, "seed": 1}, {"seed": 1})], True),  # the whole spec replaced
        ([("change", ("spec", "suspend"), False, True)], False),  # suspending
        ([("add", ("spec", "suspend"), None, False)], False),
        ([("change", ("spec", "actors", "replicas"), 2, 5)], False),
        (None, False),  # create and operator-restart causes carry no diff
    ],
)
def test_a_resume_is_seen_however_kopf_reports_it(diff: Any, lifted: bool) -> None:
    assert resumed(diff) is lifted


def test_messages_name_what_scales() -> None:
    tier = RLJobSpec.model_validate({"rollout": {"replicas": 2}})
    assert suspending(tier).message.startswith("actors and rollout servers scaled to 0")
    assert suspending(RLJobSpec()).message.startswith("actors scaled to 0")
    colocated = RLJobSpec.model_validate({"mode": "colocated"})
    assert suspending(colocated).message == "the learner checkpoints and stops"
    assert "actors" not in resuming(colocated).message and "rollout servers scaled back" in resuming(tier).message
    assert {suspending(tier).type, resuming(tier).type} == {"Normal"}


def test_created_children_are_listed_briefly_and_nothing_is_posted_for_nothing() -> None:
    assert children_created([]) is None and rollout_changed([]) is None
    created = [f"ConfigMap/c{i}" for i in range(MAX_LISTED + 3)]
    event = children_created(created)
    assert event is not None and event.reason == "CreatedChildren"
    assert event.message.endswith("(+3 more)") and f"c{MAX_LISTED - 1}" in event.message and f"c{MAX_LISTED}" not in event.message
    healed = children_created(["Deployment/lake-actor"], missing=True)
    assert healed is not None and healed.reason == "RecreatedChildren" and "lake-actor" in healed.message
