"""Fixtures shared by the core tests."""

import pytest

# The smallest job that runs end to end through `stoker run`: one actor, one map, one bucket.
TINY_JOB = """\
apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {name: tiny}
spec:
  model: {architecture: {vocabSize: 32, hiddenSize: 32, numLayers: 1, intermediateSize: 64, maxSeqLen: 128}}
  environment: {name: frozenlake, maxTurns: 3, frozenlake: {mapSeeds: [1]}, sandbox: {kind: inline}}
  actors: {replicas: 1, concurrency: 2}
  buffer: {groupSize: 2, maxStaleness: 2}
  learner: {batchGroups: 1, sequenceBuckets: [128], maxSteps: 50, checkpoint: {intervalSteps: 1}}
"""


@pytest.fixture(scope="session")
def tiny_job() -> str:
    """The manifest text of ``TINY_JOB``."""
    return TINY_JOB
