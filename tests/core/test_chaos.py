"""The chaos benchmark, small (issue 53): kill -9 the learner while it writes a checkpoint, the
buffer while Puts arrive and an actor, on the tiny job with process sandboxes; the run must still
finish, and nothing acknowledged be lost, nor anything left running."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 80
CHECKPOINT_INTERVAL = 1  # TINY_JOB's learner.checkpoint.intervalSteps
MAX_STALL_SECONDS = 30.0  # after a buffer or actor kill


def _chaos() -> ModuleType:
    """benchmarks/chaos.py (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("stoker_benchmarks_chaos", REPO / "benchmarks" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_a_run_under_chaos_finishes_loses_nothing_acknowledged_and_leaves_nothing_behind(
    tmp_path: Path, tiny_job: str, jax_cache_env: dict[str, str]
) -> None:
    chaos = _chaos()
    manifest = tmp_path / "tiny.yaml"
    # Process sandboxes (the default), so a killed actor has sandboxes to leave behind.
    manifest.write_text(tiny_job.replace(", sandbox: {kind: inline}", ""))
    run = chaos.ChaosRun(manifest, tmp_path / "run", ["--max-steps", str(MAX_STEPS)], kills=3, interval=2.0,
                         env=jax_cache_env)
    figures = run.run(timeout=240)
    report = chaos.markdown(figures) + f"\nstderr: {(tmp_path / 'run' / 'stoker-run.stderr').read_text()[-3000:]}"

    assert figures["exit_code"] == 0 and figures["steps"] == MAX_STEPS, report
    kills = {k["role"]: k for k in figures["kills"]}
    assert sorted(kills) == ["actor", "buffer", "learner"], report
    assert all(k["restarted"] and k["on_cue"] for k in kills.values()), report
    # It resumed from the newest complete checkpoint; what it had trained since is lost: at most an
    # interval, even though saves are asynchronous (learner/checkpoint_schedule.py).
    learner = kills["learner"]
    assert learner["restored_from"] == learner["checkpoint"], report
    assert 0 <= learner["steps_lost"] <= CHECKPOINT_INTERVAL, report
    for role in ("buffer", "actor"):
        assert kills[role]["stall_seconds"] is not None and kills[role]["stall_seconds"] <= MAX_STALL_SECONDS, report

    trajectories = figures["trajectories"]
    assert trajectories["acknowledged_lower_bound"] > 0 and trajectories["durable"] >= trajectories["acknowledged_lower_bound"], report
    assert trajectories["lost"] == 0, report
    assert figures["leftover_processes"] == [] and figures["leftover_sandbox_dirs"] == [], report
