"""``stoker actor`` as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stoker.buffer.client import BufferClient
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings

MANIFEST = """\
apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {name: cli-test}
spec:
  model:
    architecture: {vocabSize: 32, hiddenSize: 16, numLayers: 1, numHeads: 2, numKvHeads: 1,
                   intermediateSize: 32, maxSeqLen: 256}
  environment:
    maxTurns: 3
    sandbox: {kind: process}
  actors: {concurrency: 2, sampling: {maxNewTokens: 2}}
  buffer: {groupSize: 2}
  learner: {sequenceBuckets: [128, 256]}
"""


def stoker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", "actor", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BufferServer]:
    buffer = BufferServer(BufferSettings(group_size=2, sync="none"), tmp_path / "wal").start()
    yield buffer
    buffer.stop(grace=0.1)


def test_invalid_manifest_is_explained_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFEST.replace("maxTurns: 3", "maxTurns: 0"))
    done = stoker("--manifest", str(bad), "--buffer", "127.0.0.1:1")
    assert done.returncode == 2
    assert "spec.environment.maxTurns" in done.stderr and "Traceback" not in done.stderr


def test_missing_token_file_is_explained(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(MANIFEST)
    done = stoker("--manifest", str(manifest), "--buffer", "127.0.0.1:1", "--token-file", str(tmp_path / "nope"))
    assert done.returncode == 2 and "--token-file" in done.stderr and "Traceback" not in done.stderr


def test_vocabulary_too_small_for_the_tokenizer_is_explained(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(MANIFEST.replace("vocabSize: 32", "vocabSize: 16"))
    done = stoker("--manifest", str(manifest), "--buffer", "127.0.0.1:1")
    assert done.returncode == 2 and "vocabSize" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_actor_process_fills_the_buffer_with_whole_groups(tmp_path: Path, server: BufferServer) -> None:
    from stoker.model.hf import to_hf
    from stoker.model.model import init_model
    from stoker.weights.channel import WeightPublisher
    from stoker.manifest import load_job

    manifest = tmp_path / "job.yaml"
    manifest.write_text(MANIFEST)
    weights = tmp_path / "weights"
    weights.mkdir()
    architecture = load_job(manifest).spec.model.architecture
    WeightPublisher(directory=weights).publish(1, to_hf(init_model(architecture, seed=1)))
    done = stoker(
        "--manifest", str(manifest), "--buffer", f"127.0.0.1:{server.port}", "--weights", str(weights),
        "--actor-id", "a0", "--max-groups", "2",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    learner = BufferClient(f"127.0.0.1:{server.port}", learner_id="learner")
    batch = learner.sample(max_groups=2, min_groups=2, timeout=5.0)
    learner.close()
    assert batch is not None and len(batch.groups) == 2
    for group in batch.groups:
        assert len(group.episodes) == 2 and {e.actor_id for e in group.episodes} == {"a0"}
        for episode in group.episodes:
            assert episode.loss_mask.sum() > 0 and episode.num_turns >= 1
    versions = {int(v) for g in batch.groups for e in g.episodes for v in e.policy_versions[e.loss_mask == 1]}
    assert 1 in versions and versions <= {0, 1}  # it pulled the published weights while running
    assert "policy version 1" in done.stderr
