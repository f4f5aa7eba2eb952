"""`stoker run` end to end on a tiny FrozenLake job: both modes, resume, and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker.procstat import proc_stat

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, tiny_job: str, jax_cache_env: dict[str, str]) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("run")
    manifest = root / "tiny.yaml"
    # With a held-out map: the async run's actor plays evaluation rounds (the sync baseline does not).
    with_eval = tiny_job.replace("sandbox: {kind: inline}}", "sandbox: {kind: inline}, evalTasks: ['5'], evalEveryVersions: 1}")
    assert with_eval != tiny_job
    manifest.write_text(with_eval)
    # The session's compilation cache (tests/conftest.py): later runs reuse what the first compiled.
    env = {**os.environ, **jax_cache_env}
    return manifest, env


def _run(manifest: Path, run_dir: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(run_dir), "--no-progress", *extra],
        capture_output=True, text=True, env=env, timeout=400,
    )


def _steps(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / "learner_metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_run_trains_reports_and_resumes(job: tuple[Path, dict[str, str]], tmp_path: Path, mode: str) -> None:
    manifest, env = job
    first = _run(manifest, tmp_path, env, "--mode", mode, "--max-steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    steps = _steps(tmp_path)
    assert [s["step"] for s in steps] == [1, 2]
    assert (tmp_path / "report.md").read_text().startswith("# Run report")
    assert (tmp_path / "plots" / "success.png").exists()
    if mode == "async":
        # Round 0 starts with the actor, before any training episode ends, and a stopping actor
        # finishes and reports the round it is playing.
        actor_log = (tmp_path / "logs" / "actor-0.log").read_text()
        assert "evaluation round at version 0" in actor_log, actor_log[-2000:]
    else:
        # The synchronous loop's time split, a line a step; the report's section from the second on.
        split = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
        assert [p["step"] for p in split] == [1, 2]
        assert all(0 < p["generate_seconds"] <= p["play_seconds"] < p["wall_seconds"] for p in split)
        assert all(p["sampled_tokens"] > 0 for p in split)
        assert split[0]["compile_seconds"] > 0.5 * split[0]["wall_seconds"]  # the first step compiles every program
        assert [p["trained_tokens"] for p in split] == [s.get("tokens", 0.0) for s in steps]  # a flat batch trains none
        assert "## Where a step's time went (1 steps after the first" in (tmp_path / "report.md").read_text()
    second = _run(manifest, tmp_path, env, "--mode", mode, "--max-steps", "3")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = _steps(tmp_path)[2:]
    # Resumed from the step-2 checkpoint: one more step, and the version continues from where it
    # was (a step whose batch had no reward spread makes no update: steps count batches).
    assert [s["step"] for s in resumed] == [3]
    assert resumed[0]["policy_version"] == steps[-1]["policy_version"] + int(resumed[0]["trained"])


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process still running (a zombie, dead and waiting to be reaped by
    whoever adopted it, is not)."""
    try:
        return proc_stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, frontier = set(), [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.add(child)
            frontier.append(child)
    return found


def test_ctrl_c_stops_every_process_and_keeps_the_checkpoint(job: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    manifest, env = job
    runner = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(tmp_path), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    metrics = tmp_path / "learner_metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert runner.poll() is None, runner.communicate()[1][-3000:]
        time.sleep(0.2)  # polling for the first training step, not papering over a race
    spawned = _descendants(runner.pid)
    assert len(spawned) >= 3  # buffer, learner, actor (and the actor's children)
    runner.send_signal(signal.SIGINT)
    _, stderr = runner.communicate(timeout=120)
    assert runner.returncode == 130, stderr[-3000:]
    assert "interrupted" in stderr
    alive = {pid for pid in spawned if _running(pid)}
    assert not alive, f"orphans left behind: {alive}"
    assert any((tmp_path / "checkpoints").iterdir())
