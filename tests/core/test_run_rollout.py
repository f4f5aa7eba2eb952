"""`stoker run` with `spec.rollout`: one rollout server process, actors that sample from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.manifest import load_job

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_rollout_example_is_the_frozenlake_job_with_a_rollout_server() -> None:
    """The example measured to learn (benchmarks/README.md) differs from frozenlake.yaml only there."""
    plain, remote = load_job(EXAMPLES / "frozenlake.yaml"), load_job(EXAMPLES / "frozenlake-rollout.yaml")
    assert plain.spec.rollout is None and remote.spec.rollout is not None
    assert remote.spec.model_copy(update={"rollout": None}) == plain.spec


def test_run_with_a_two_process_rollout_server_trains_and_keeps_the_logprob_check(
    tmp_path: Path, tiny_job: str, jax_env: dict[str, str]
) -> None:
    """The server runs as two JAX processes (one mesh, process 0 serving), as on a multi-host
    slice; everything the actors and the learner see is as with one."""
    manifest = tmp_path / "tiny-rollout.yaml"
    # Shaped rewards and groups of 4: a group whose episodes all score alike trains nothing, and
    # the log-prob check below needs trained tokens.
    job = tiny_job.replace("mapSeeds: [1]}", "mapSeeds: [1], rewardShaping: true}").replace("groupSize: 2", "groupSize: 4")
    manifest.write_text(job.replace("concurrency: 2", "concurrency: 4") + "  rollout: {maxBatch: 4}\n")
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(run_dir), "--no-progress",
         "--max-steps", "3", "--rollout-processes", "2"],
        capture_output=True, text=True, env=jax_env, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines() if line]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # The learner's sampler-vs-trainer check on the server's tokens: same-version log-probs agree.
    diffs = [s["tito_logprob_diff_mean"] for s in steps if s.get("tito_tokens")]
    assert diffs and max(abs(d) for d in diffs) < 1e-4
    logs = run_dir / "logs"
    # Over the run's unix sockets (stoker run's default transport).
    sockets = run_dir / "sockets"
    assert f"samples from the rollout server at unix://{sockets}/rollout.sock" in (logs / "actor-0.log").read_text()
    assert f"rollout server on unix://{sockets}/rollout.sock" in (logs / "rollout.log").read_text()
    assert "rollout host 1 of 2" in (logs / "rollout-1.log").read_text()
