"""An actor's XLA CPU pools are its share of the host, not one thread per core of the whole host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stoker import chips
from stoker.cpu_threads import CPU_THREADS_ENV, cpu_share, start_jax_cpu
from stoker.runner import local, placement
from stoker.runner.local import AsyncRun, RunOptions
from stoker.spec import RLJob

PROBE = r"""
import json, os, sys
from stoker.cpu_threads import start_jax_cpu
mask = sorted(os.sched_getaffinity(0))
threads = None if sys.argv[1] == "none" else int(sys.argv[1])
used = start_jax_cpu(threads)
import jax
jax.devices()
print(json.dumps({"used": used, "threads": len(os.listdir("/proc/self/task")),
                  "mask_before": mask, "mask_after": sorted(os.sched_getaffinity(0))}))
"""


def probe(threads: str) -> dict[str, object]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", PROBE, threads], env=env, capture_output=True, text=True, timeout=120, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to size a pool below the host")
def test_jax_starts_with_smaller_cpu_pools_and_the_process_keeps_every_core() -> None:
    default, one = probe("none"), probe("1")
    assert default["used"] is None and one["used"] == 1
    assert int(one["threads"]) < int(default["threads"])  # type: ignore[call-overload]
    assert one["mask_after"] == one["mask_before"]  # the threads still run on any core


def test_a_share_at_least_the_host_leaves_jax_alone() -> None:
    cores = len(os.sched_getaffinity(0))
    assert start_jax_cpu(None) is None and start_jax_cpu(cores) is None


def test_the_share_comes_from_the_setting_else_the_cpu_quota() -> None:
    assert cpu_share({CPU_THREADS_ENV: "3"}, quota=8.0) == 3
    assert cpu_share({}, quota=2.5) == 3  # a pod's limits.cpu of 2.5 feeds 3 threads a little
    assert cpu_share({}, quota=None) is None or cpu_share({}, quota=None) >= 1  # this machine's own quota, if any
    for bad in ("0", "two", "-1", "1.5"):
        with pytest.raises(ValueError, match=f"{CPU_THREADS_ENV}='{bad}': expected a whole number of threads, 1 or more"):
            cpu_share({CPU_THREADS_ENV: bad}, quota=None)


def test_a_local_run_gives_each_actor_its_share_of_the_cores_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[str, dict[str, str]]] = []

    class RecordingChild:
        def __init__(self, name: str, argv: list[str], log: Path):
            self.name, self.argv = name, argv

        def start(self, env: dict[str, str]) -> None:
            started.append((self.name, env))

    monkeypatch.setattr(local, "Child", RecordingChild)
    monkeypatch.setattr(local, "wait_for_ready_file", lambda path, child: f"unix://{tmp_path}/buffer.sock")
    monkeypatch.setattr(chips, "host_chips", lambda dev="/dev": [])
    monkeypatch.setattr(placement, "host_cores", lambda: 13)
    job = RLJob.model_validate({"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "lake"},
                                "spec": {"actors": {"replicas": 3}}})
    options = RunOptions(manifest=tmp_path / "job.yaml", job=job, mode="async", run_dir=tmp_path / "run", live=False)
    AsyncRun(options).start({"PATH": "/bin"})
    envs = dict(started)
    assert envs["actor-0"][CPU_THREADS_ENV] == "3" and envs["actor-2"][CPU_THREADS_ENV] == "3"  # (13 - 2) // 3
    assert CPU_THREADS_ENV not in envs["learner"] and CPU_THREADS_ENV not in envs["buffer"]
    started.clear()
    AsyncRun(RunOptions(manifest=tmp_path / "job.yaml", job=job, mode="async", run_dir=tmp_path / "run2", live=False)).start(
        {"PATH": "/bin", CPU_THREADS_ENV: "2"}
    )
    assert dict(started)["actor-1"][CPU_THREADS_ENV] == "2"  # the user's own setting is kept
