"""`stoker run --learner-processes 2`: the learner as two JAX processes on loopback, from the main
command -- it trains, side effects happen once, and Ctrl-C stops every process with a checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker.runner.local import UsageError, resolve_options
from stoker.runner.placement import jax_process_envs

pytestmark = pytest.mark.slow


def test_two_learner_processes_train_once_and_stop_together_on_ctrl_c(tmp_path: Path, tiny_job: str, jax_env: dict[str, str]) -> None:
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(tiny_job)
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(run_dir), "--no-progress",
         "--learner-processes", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=jax_env,
    )
    metrics = run_dir / "learner_metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert runner.poll() is None, runner.communicate()[1][-3000:]
        time.sleep(0.2)  # polling for training steps, not papering over a race
    runner.send_signal(signal.SIGINT)
    _, stderr = runner.communicate(timeout=180)
    assert runner.returncode == 130, stderr[-3000:]
    assert "interrupted" in stderr
    # Both processes ran as one JAX job of two processes.
    logs = run_dir / "logs"
    assert (logs / "learner.log").exists() and (logs / "learner-1.log").exists()
    assert "processes=2, process_id=1" in (logs / "learner-1.log").read_text()
    # Training progressed, and each step was recorded once (only process 0 writes metrics).
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
    assert len(steps) >= 3 and steps == list(range(1, len(steps) + 1))
    # Weights were published (by process 0: only it has a publisher), and the final checkpoint
    # was written by both processes together at the step both stopped at.
    assert json.loads((run_dir / "weights" / "LATEST.json").read_text())["policy_version"] >= 1
    saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved >= steps[-1]
    assert (run_dir / "report.md").exists()


def test_learner_process_environments() -> None:
    base = {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8", "PATH": "/bin"}
    assert jax_process_envs(base, 1, 4) == [base]
    envs = jax_process_envs(base, 3, 2)
    assert [e["STOKER_PROCESS_ID"] for e in envs] == ["0", "1", "2"]
    assert {e["STOKER_NUM_PROCESSES"] for e in envs} == {"3"}
    assert len({e["STOKER_COORDINATOR_ADDRESS"] for e in envs}) == 1
    assert envs[0]["STOKER_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
    # Each process gets its own device count; other XLA flags are kept.
    assert envs[1]["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"
    assert envs[2]["JAX_PLATFORMS"] == "cpu"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learner-processes", "0"], "both must be >= 1"),
        (["--learner-processes", "2", "--mode", "sync"], "applies to --mode async"),
    ],
)
def test_bad_learner_process_options_are_explained(tmp_path: Path, argv: list[str], message: str, tiny_job: str) -> None:
    import argparse

    from stoker.runner.local import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(tiny_job)
    with pytest.raises(UsageError, match=message):
        resolve_options(parser.parse_args([str(manifest), *argv]))
