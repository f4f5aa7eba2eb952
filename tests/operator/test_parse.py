"""What the operator refuses to run, and the message the user sees in status."""

from __future__ import annotations

import pytest

from stoker.operator.reconcile import InvalidJob, parse_spec


@pytest.mark.parametrize(
    ("name", "spec", "reason", "words"),
    [
        ("lake", {"learner": {"accelerator": "tpu-v4-podslice", "topology": "2x4"}}, "InvalidTopology",
         ["spec.learner.topology", "3-D"]),
        ("lake", {"learner": {"accelerator": "tpu-v5p-slice"}}, "InvalidSpec", ["spec.learner.topology", "missing"]),
        ("lake", {"actors": {"replicas": "many"}}, "InvalidSpec", ["spec.actors.replicas"]),
        ("9lives", {}, "InvalidSpec", ["metadata.name", "starting with a letter"]),
        ("x" * 40, {}, "InvalidSpec", ["metadata.name", "at most 39"]),
        ("x" * 39, {"learner": {"accelerator": "tpu-v5p-slice", "topology": "4x4x8", "numSlices": 10}}, "InvalidSpec",
         ["at most 38 for 10 slice(s) of 32 host(s)"]),
    ],
)
def test_invalid_jobs_say_why(name: str, spec: dict[str, object], reason: str, words: list[str]) -> None:
    with pytest.raises(InvalidJob) as caught:
        parse_spec(name, spec)
    assert caught.value.reason == reason
    for word in words:
        assert word in str(caught.value)


def test_valid_job_parses() -> None:
    spec = parse_spec("lake", {"learner": {"accelerator": "tpu-v6e-slice", "topology": "2x4"}})
    assert spec.learner.topology == "2x4"
