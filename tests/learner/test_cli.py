"""``stoker learner`` against a real buffer on loopback: trains, commits, publishes, resumes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from stoker.buffer.client import BufferClient
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.cli import main as stoker_main
from stoker.weights.channel import WeightSubscriber
from stoker.manifest import load_job
from stoker.trajectory import Episode

# The learner turns on a process-wide persistent compilation cache; the fixture turns it off after.
pytestmark = pytest.mark.usefixtures("xla_cache")

GROUP_SIZE = 4

MANIFEST = {
    "apiVersion": "stoker.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "learner-cli"},
    "spec": {
        "model": {
            "architecture": {
                "vocabSize": 8, "hiddenSize": 16, "numLayers": 1, "numHeads": 2, "numKvHeads": 1,
                "intermediateSize": 32, "maxSeqLen": 64,
            }
        },
        "algorithm": {"name": "grpo", "learningRate": 0.05},
        "buffer": {"groupSize": GROUP_SIZE, "maxStaleness": 16},
        "learner": {
            "batchGroups": 2, "sequenceBuckets": [16, 32], "microbatchTokens": 64,
            "checkpoint": {"dir": "ckpt", "intervalSteps": 2}, "compilationCacheDir": "xla-cache",
        },
    },
}


def episodes(rng: np.random.Generator, group: str) -> list[Episode]:
    out = []
    for index in range(GROUP_SIZE):
        token = int(rng.integers(0, 8))
        out.append(
            Episode(
                episode_id=uuid.uuid4().hex, group_id=group, group_size=GROUP_SIZE, task_id="bandit",
                token_ids=np.asarray([1, 2, token], np.int32), loss_mask=np.asarray([0, 0, 1], np.uint8),
                logprobs=np.asarray([0, 0, np.log(1 / 8)], np.float32),
                policy_versions=np.asarray([-1, -1, 0], np.int32), reward=float(index % 2), status=1,
            )
        )
    return out


@pytest.mark.slow
def test_learner_cli_trains_from_a_real_buffer_and_resumes(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(MANIFEST))
    spec = load_job(manifest).spec
    token = "s3cret"
    (tmp_path / "token").write_text(token)
    server = BufferServer(BufferSettings.from_spec(spec), tmp_path / "wal", token=token).start()
    try:
        client = BufferClient(f"127.0.0.1:{server.port}", token)
        rng = np.random.default_rng(0)
        client.put([e for g in range(10) for e in episodes(rng, f"g{g}")])
        run_dir = tmp_path / "run"
        args = [
            "learner", "--manifest", str(manifest), "--buffer", f"127.0.0.1:{server.port}",
            "--token-file", str(tmp_path / "token"), "--run-dir", str(run_dir),
            "--weights-dir", str(tmp_path / "weights"), "--log-level", "warning",
        ]
        assert stoker_main([*args, "--max-steps", "3"]) == 0
        stats = client.stats()
        assert stats.policy_version == 3
        assert stats.committed_total == 3 * 2 * GROUP_SIZE
        with WeightSubscriber(directory=tmp_path / "weights") as sub:
            assert sub.latest_version() == 3
        lines = [json.loads(x) for x in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
        assert [x["policy_version"] for x in lines] == [1, 2, 3]
        assert any(p.name.isdigit() for p in (run_dir / "ckpt").iterdir())
        assert any((run_dir / "xla-cache").iterdir())  # the persistent compilation cache was written

        # Restarted, it resumes at version 3 and continues to 5 on the remaining groups.
        assert stoker_main([*args, "--max-steps", "5"]) == 0
        assert client.stats().policy_version == 5
        lines = [json.loads(x) for x in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
        assert [x["policy_version"] for x in lines] == [1, 2, 3, 4, 5]
        # The second process compiled nothing new: every program came from the persistent cache.
        assert lines[-1]["compile_cache_hits"] > 0
    finally:
        server.stop()


@pytest.mark.slow
def test_learner_killed_mid_run_resumes_with_a_monotonic_version(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(MANIFEST))
    spec = load_job(manifest).spec
    server = BufferServer(BufferSettings.from_spec(spec), tmp_path / "wal").start()
    run_dir = tmp_path / "run"
    metrics = run_dir / "learner_metrics.jsonl"
    args = ["learner", "--manifest", str(manifest), "--buffer", f"127.0.0.1:{server.port}", "--run-dir", str(run_dir)]
    try:
        client = BufferClient(f"127.0.0.1:{server.port}")
        rng = np.random.default_rng(1)
        client.put([e for g in range(40) for e in episodes(rng, f"g{g}")])
        proc = subprocess.Popen([sys.executable, "-m", "stoker.cli", *args, "--max-steps", "1000", "--log-level", "error"])
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                done = metrics.read_text().count("\n") if metrics.exists() else 0
                if done >= 5 and any(p.name.isdigit() for p in (run_dir / "ckpt").iterdir()):
                    break
                time.sleep(0.05)  # polling the run's own files, not waiting out a race
            assert proc.poll() is None, "the learner exited early"
        finally:
            proc.kill()
            proc.wait(timeout=30)
        killed_at = max(json.loads(x)["policy_version"] for x in metrics.read_text().splitlines())
        saved = max(int(p.name) for p in (run_dir / "ckpt").iterdir() if p.name.isdigit())
        assert 2 <= saved <= killed_at
        target = saved + 3  # steps: the restarted learner makes 3 more updates from its checkpoint
        assert stoker_main([*args, "--max-steps", str(target), "--log-level", "warning"]) == 0
        versions = [json.loads(x)["policy_version"] for x in metrics.read_text().splitlines()]
        steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
        # Steps resume from the checkpoint; versions never repeat (the weights of the versions
        # reached after the checkpoint died with the process, so those numbers are skipped).
        assert steps[-3:] == [saved + 1, saved + 2, saved + 3]
        assert versions == sorted(set(versions)) and versions[-3] > killed_at
        assert client.stats().policy_version == versions[-1]
    finally:
        server.stop()


def test_learner_cli_explains_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nspec: {learner: {batchGroups: 0}}\n")
    assert stoker_main(["learner", "--manifest", str(bad), "--buffer", "x:1", "--run-dir", str(tmp_path)]) == 2
    assert "spec.learner.batchGroups" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(MANIFEST))
    assert stoker_main(["learner", "--manifest", str(good), "--run-dir", str(tmp_path)]) == 2
    assert "--buffer is required" in capsys.readouterr().err
    missing = ["learner", "--manifest", str(good), "--buffer", "x:1", "--run-dir", str(tmp_path), "--token-file", "/nope"]
    assert stoker_main(missing) == 2
    assert "--token-file /nope" in capsys.readouterr().err


COLOCATED = """\
apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {name: colocated}
spec:
  mode: colocated
  model: {architecture: {vocabSize: 32, hiddenSize: 32, numLayers: 1, intermediateSize: 64, maxSeqLen: 128}}
  environment: {name: frozenlake, maxTurns: 3, frozenlake: {mapSeeds: [1], rewardShaping: true}, sandbox: {kind: inline}}
  buffer: {groupSize: 4}
  learner: {batchGroups: 1, sequenceBuckets: [128], maxSteps: 50}
"""


def test_a_colocated_learner_plays_its_own_episodes_without_a_buffer(tmp_path: Path) -> None:
    """The operator's colocated learner pod runs `stoker learner` with no --buffer: it samples,
    steps the environment and trains by itself (before, it refused to start without a buffer)."""
    manifest = tmp_path / "colocated.yaml"
    manifest.write_text(COLOCATED)
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "learner", "--manifest", str(manifest), "--run-dir", str(run),
         "--max-steps", "2"],
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "learner_metrics.jsonl").read_text().splitlines() if line]
    assert [s["step"] for s in steps] == [1, 2] and all(s["episodes"] == 4 for s in steps)
    assert "done: 2 steps" in done.stderr
    # A learner slice of several hosts cannot run the single-process loop: refused in one line.
    several = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "learner", "--manifest", str(manifest), "--run-dir", str(run)],
        capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "STOKER_NUM_PROCESSES": "2", "STOKER_COORDINATOR_ADDRESS": "127.0.0.1:1"},
    )
    assert several.returncode != 0 and "mode: colocated runs on one host" in several.stderr
