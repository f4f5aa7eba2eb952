"""Fixtures of the sizing tests: job manifests written for the slice under test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# A tiny job: one bucket, so its learner is three programs (grad, apply, publish).
JOB = """\
apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {name: plan}
spec:
  model:
    architecture: {vocabSize: %(vocab)d, hiddenSize: %(hidden)d, numLayers: %(layers)d, numHeads: 4, numKvHeads: 2,
                   intermediateSize: %(mlp)d, maxSeqLen: 512}
    attention: %(attention)s
  environment: {name: frozenlake, maxTurns: 3}
  buffer: {groupSize: 4}
  learner: {batchGroups: 2, sequenceBuckets: [%(bucket)d]%(learner)s}
%(rollout)s"""


@pytest.fixture
def job(tmp_path: Path) -> Callable[..., Path]:
    """Write a job manifest; keyword arguments change the tiny defaults."""

    def write(**changes: object) -> Path:
        values: dict[str, object] = {"vocab": 256, "hidden": 64, "layers": 1, "mlp": 128, "attention": "auto",
                                     "bucket": 128, "learner": "", "rollout": ""}
        values.update(changes)
        path = tmp_path / "job.yaml"
        path.write_text(JOB % values)
        return path

    return write
