"""One learner over several real JAX processes (jax.distributed on loopback, gloo collectives).

Two processes with two CPU devices each train exactly as one process with four devices: the same
batches reach every process once, side effects happen once, Orbax checkpoints save and restore
with every process, and a process that dies takes the group down within the heartbeat bound.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")
LEARNING_RATE = 0.01  # the worker's


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def process_envs(processes: int, cache: Path, heartbeat: int = 20) -> list[dict[str, str]]:
    env = {
        **os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    if processes == 1:
        return [env]
    shared = {
        **env, "STOKER_NUM_PROCESSES": str(processes), "STOKER_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "STOKER_HEARTBEAT_TIMEOUT_SECONDS": str(heartbeat),
    }
    return [{**shared, "STOKER_PROCESS_ID": str(i)} for i in range(processes)]


def start_workers(out: Path, processes: int, devices: int, meshes: list[str], steps: int, cache: Path) -> list[subprocess.Popen[str]]:
    out.mkdir(parents=True)
    argv = [sys.executable, str(WORKER), str(out), "--devices", str(devices), "--steps", str(steps)]
    for mesh in meshes:
        argv += ["--mesh", mesh]
    return [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for env in process_envs(processes, cache)
    ]


def finish(procs: list[subprocess.Popen[str]], timeout: float = 280) -> None:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for index, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {index} exited {proc.returncode}:\n{output[-4000:]}"


@pytest.mark.slow
def test_two_processes_train_exactly_as_one_with_the_same_devices(tmp_path: Path, xla_cache_dir: Path) -> None:
    meshes, steps = ["4x1", "2x2"], 3  # FSDP over all four devices; FSDP 2 x TP 2
    single = start_workers(tmp_path / "one", 1, 4, meshes, steps, xla_cache_dir)
    multi = start_workers(tmp_path / "two", 2, 2, meshes, steps, xla_cache_dir)
    finish(single + multi)
    for mesh in meshes:
        one, two = (json.loads((tmp_path / d / f"{mesh}.json").read_text()) for d in ("one", "two"))
        assert (one["processes"], two["processes"], one["devices"], two["devices"]) == (1, 2, 4, 4)
        # Parameters really are split, and each process holds only its devices' pieces.
        assert one["embedding_shards"] == 4 and two["embedding_shards"] == 2
        # Side effects once: each batch sampled once, committed once, in order; every version
        # published once and reported once, in order; one metrics record per step.
        for run in (one, two):
            assert run["made"] == run["version"] == run["steps"] == steps
            assert run["committed"] == run["sampled"] and len(run["sampled"]) == steps
            assert run["published"] == run["versions"] == list(range(steps + 1))
            assert run["records"] == steps
            assert run["resumed_at"] == [steps, steps]  # Orbax restored the step and version
        # Packing and bucketing as in one process: the same programs, compiled as often.
        assert two["programs"] == one["programs"]

        a, b = (np.load(tmp_path / d / f"{mesh}.npz") for d in ("one", "two"))
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5, err_msg=mesh)
        names = [k[len("param/") :] for k in a.files if k.startswith("param/")]
        assert names and sorted(names) == sorted(k[len("param/") :] for k in b.files if k.startswith("param/"))
        for name in names:
            # Within one run, what was published and what Orbax restored are the trained weights.
            for run in (a, b):
                np.testing.assert_array_equal(run[f"published/{name}"], run[f"param/{name}"])
                np.testing.assert_array_equal(run[f"restored/{name}"], run[f"param/{name}"])
            # Across runs: float32 agreement. Adam's first steps move every weight by about
            # sign(g) * lr, so a gradient entry within rounding of 0 (summed in another order over
            # the four devices) can move its weight by a fraction of lr; all others agree to 1e-5.
            diff = np.abs(b[f"param/{name}"] - a[f"param/{name}"])
            assert diff.max() <= 0.25 * LEARNING_RATE, (mesh, name, float(diff.max()))
            assert (diff > 1e-5).mean() < 0.005, (mesh, name, float((diff > 1e-5).mean()))
