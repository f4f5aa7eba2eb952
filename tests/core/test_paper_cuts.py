"""Small things a new user tripped over: plugins beside the manifest, what an import error calls a
reward, TensorBoard tags, and a rollout log that is all weight versions."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.learner.metrics import MetricsSink, tensorboard_tag

JOB = """apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {name: t}
spec:
  environment:
    sandbox: {kind: inline}
    reward: {terms: [{function: 'besideme:brief'}, {function: 'nosuchmodule:f'}]}
"""


def test_a_reward_module_beside_the_manifest_needs_no_pythonpath(tmp_path: Path) -> None:
    (tmp_path / "besideme.py").write_text("def brief(context):\n    return 0.0\n")
    manifest = tmp_path / "job.yaml"
    manifest.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "validate", str(manifest)], capture_output=True,
                          text=True, env=env, cwd="/")
    assert done.returncode == 2
    assert "terms[0]" not in done.stderr  # found beside the manifest
    [line] = done.stderr.strip().splitlines()
    assert "terms[1].function: reward 'nosuchmodule:f': cannot import nosuchmodule" in line  # a reward, not an "environment"
    assert "beside the manifest" in line and "PYTHONPATH" in line


def test_tensorboard_tags_are_legal_so_tensorboardx_never_complains(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert tensorboard_tag("reward/myrewards:brief") == "reward/myrewards_brief"
    with caplog.at_level(logging.INFO), MetricsSink(tmp_path / "m.jsonl") as sink:
        for step in range(3):
            sink.record({"step": step, "reward/myrewards:brief": 0.5, "episode_correct answer": 1.0})
    assert not [r for r in caplog.records if "illegal" in r.getMessage().lower()]


def test_the_rollout_log_announces_weight_versions_at_most_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    from stoker.rollout.turns import VersionLog

    clock = [1000.0]
    versions = VersionLog(clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="stoker.rollout"):
        for version in range(1, 101):  # a learner publishing every step, 1 s apart
            versions.changed(version)
            clock[0] += 1.0
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert lines == [
        "rollout engine now samples new turns with policy version 1",
        "rollout engine now samples new turns with policy version 61 (60 versions since the last such line)",
    ]


def test_stoker_runs_processes_find_modules_beside_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.runner.local import RunOptions, child_env
    from stoker.spec import RLJob

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    options = RunOptions(manifest=tmp_path / "job.yaml", job=RLJob(), mode="async", run_dir=tmp_path / "run")
    assert child_env(options)["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]


def test_both_modes_compile_into_the_cache_jax_compilation_cache_dir_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The async run's children read JAX_COMPILATION_CACHE_DIR themselves; the sync run's
    in-process learner is given the same directory, not ~/.cache/stoker/jax; the spec's wins."""
    from stoker.runner.local import DEFAULT_COMPILATION_CACHE, RunOptions, child_env, compilation_cache_dir
    from stoker.spec import RLJob

    options = RunOptions(manifest=tmp_path / "job.yaml", job=RLJob(), mode="sync", run_dir=tmp_path / "run")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert compilation_cache_dir(options) == child_env(options)["JAX_COMPILATION_CACHE_DIR"] == str(DEFAULT_COMPILATION_CACHE)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env-cache"))
    assert compilation_cache_dir(options) == child_env(options)["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "env-cache")
    spec = RLJob().spec
    job = RLJob(spec=spec.model_copy(update={"learner": spec.learner.model_copy(update={"compilation_cache_dir": str(tmp_path / "spec")})}))
    assert compilation_cache_dir(RunOptions(tmp_path / "job.yaml", job, "sync", tmp_path / "run")) == str(tmp_path / "spec")
