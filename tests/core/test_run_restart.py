"""`stoker run` restarts a child that dies, as a cluster would, and the run still finishes
(issue 53): kill -9 an actor, then the learner, then the buffer of a real run on the tiny job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MAX_STEPS = 12


def _child_pid(runner: int, role: str) -> int:
    """The pid of ``stoker run``'s child running ``stoker <role>`` (an actor: ``actor-0``)."""
    command, _, actor_id = role.partition("-")
    children = Path(f"/proc/{runner}/task/{runner}/children").read_text().split()
    for pid in map(int, children):
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except FileNotFoundError:
            continue  # gone since the listing
        if "stoker.cli" in words and command in words and (not actor_id or role in words):
            return pid
    raise AssertionError(f"no {role} among the children {children} of pid {runner}")


def _steps(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "learner_metrics.jsonl"
    if not path.exists():
        return []
    # The last line may be torn by a kill -9: only whole records.
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def _checkpoints(run_dir: Path) -> list[int]:
    """The steps of the learner's finished checkpoints (Orbax renames a finished one to its step)."""
    folder = run_dir / "checkpoints"
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []


def _wait_for(runner: subprocess.Popen[str], done: object, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert runner.poll() is None, f"stoker run ended before {what}:\n{runner.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)  # polling the run directory for progress, not papering over a race


def test_a_run_survives_kill_9_of_an_actor_the_learner_and_the_buffer(
    tmp_path: Path, tiny_job: str, jax_cache_env: dict[str, str]
) -> None:
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(tiny_job)
    run_dir = tmp_path / "run"
    log = (tmp_path / "stderr.txt").open("w+")
    runner = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(run_dir), "--no-progress",
         "--max-steps", str(MAX_STEPS)],
        stdout=subprocess.DEVNULL, stderr=log, text=True, env={**os.environ, **jax_cache_env},
    )

    def said(text: str) -> bool:
        return text in Path(log.name).read_text()

    try:
        _wait_for(runner, lambda: len(_steps(run_dir)) >= 1, "a first step")
        os.kill(_child_pid(runner.pid, "actor-0"), signal.SIGKILL)
        _wait_for(runner, lambda: said("stoker run: actor-0 restarted"), "the actor's restart")
        before = len(_steps(run_dir))
        _wait_for(runner, lambda: len(_steps(run_dir)) > before, "a step after the actor's restart")

        # Kill the learner once a checkpoint is written (they are saved in the background, after
        # the step's metrics): what it must resume from.
        _wait_for(runner, lambda: _checkpoints(run_dir), "a checkpoint")
        checkpoint = max(_checkpoints(run_dir))
        recorded = _steps(run_dir)
        os.kill(_child_pid(runner.pid, "learner"), signal.SIGKILL)
        killed = time.time()
        _wait_for(runner, lambda: said("stoker run: learner restarted"), "the learner's restart")
        _wait_for(runner, lambda: _steps(run_dir)[-1]["time"] > killed, "a step after the learner's restart")
        resumed = next(s for s in _steps(run_dir) if s["time"] > killed)

        before = len(_steps(run_dir))
        os.kill(_child_pid(runner.pid, "buffer"), signal.SIGKILL)
        _wait_for(runner, lambda: said("stoker run: buffer restarted"), "the buffer's restart")
        _wait_for(runner, lambda: len(_steps(run_dir)) > before, "a step after the buffer's restart")
        runner.wait(timeout=180)
    finally:
        if runner.poll() is None:
            runner.send_signal(signal.SIGINT)
            runner.wait(timeout=120)
    stderr = Path(log.name).read_text()
    assert runner.returncode == 0, stderr[-4000:]
    for role in ("actor-0", "learner", "buffer"):
        assert f"stoker run: {role} died (killed by SIGKILL); restarting {role} in 1 s" in stderr, stderr[-4000:]
    assert "restarts: buffer 1, learner 1, actor-0 1" in stderr
    steps = _steps(run_dir)
    assert steps[-1]["step"] == MAX_STEPS
    # The learner resumed from its checkpoint (one every step): its steps went on from that one's
    # (or a later one's, written as it was killed), never beyond the steps it had recorded, and its
    # version went on from the checkpoint's (a step with nothing to train on makes no update).
    assert checkpoint + 1 <= resumed["step"] <= recorded[-1]["step"] + 1, (checkpoint, recorded[-1], resumed)
    at_checkpoint = next(s for s in recorded if s["step"] == checkpoint)
    expected = at_checkpoint["policy_version"] + int(resumed["trained"])
    assert resumed["policy_version"] >= expected, (at_checkpoint, resumed)
