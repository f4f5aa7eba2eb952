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


def finish(procs: list[subprocess.Popen[str]], timeout: float = 800) -> None:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for index, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {index} exited {proc.returncode}:\n{output[-4000:]}"


@pytest.mark.slow
@pytest.mark.timeout(900)  # three JAX processes compiling on two cores; ~1 min on an idle machine
def test_two_processes_train_exactly_as_one_with_the_same_devices(tmp_path: Path, xla_cache_dir: Path) -> None:
    # FSDP over all four devices; FSDP 2 x TP 2; a mixture of experts with its 4 experts over
    # ep = 4 (the all-to-alls cross the processes).
    meshes, steps = ["4x1", "2x2", "1x4x1"], 3
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
        # The other process never touched its source, publisher or metrics sink.
        other = json.loads((tmp_path / "two" / f"{mesh}-process1.json").read_text())
        assert other == {"sampled": [], "committed": [], "versions": [], "published": [], "records": 0}
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


GROUP_SIZE = 4
HEARTBEAT_SECONDS = 10
MANIFEST = {
    "apiVersion": "stoker.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "multiprocess-kill"},
    "spec": {
        "model": {
            "architecture": {
                "vocabSize": 8, "hiddenSize": 16, "numLayers": 1, "numHeads": 2, "numKvHeads": 1,
                "intermediateSize": 32, "maxSeqLen": 64,
            }
        },
        "algorithm": {"name": "grpo", "learningRate": 0.05},
        "buffer": {"groupSize": GROUP_SIZE, "maxStaleness": 64},
        "learner": {
            "batchGroups": 2, "sequenceBuckets": [16, 32], "microbatchTokens": 64,
            "checkpoint": {"dir": "ckpt", "intervalSteps": 2},
        },
    },
}


def bandit_episodes(rng: np.random.Generator, group: str) -> list[object]:
    from stoker.trajectory import Episode

    return [
        Episode(
            episode_id=f"{group}-{i}", group_id=group, group_size=GROUP_SIZE, task_id="bandit",
            token_ids=np.asarray([1, 2, int(rng.integers(0, 8))], np.int32), loss_mask=np.asarray([0, 0, 1], np.uint8),
            logprobs=np.asarray([0, 0, np.log(1 / 8)], np.float32), policy_versions=np.asarray([-1, -1, 0], np.int32),
            reward=float(i % 2), status=1,
        )
        for i in range(GROUP_SIZE)
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_process_ends_the_group_within_the_bound_and_the_restart_loses_nothing(
    tmp_path: Path, xla_cache_dir: Path
) -> None:
    import time

    import yaml

    from stoker.buffer.client import BufferClient
    from stoker.buffer.server import BufferServer
    from stoker.buffer.settings import BufferSettings
    from stoker.manifest import load_job

    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(MANIFEST))
    server = BufferServer(BufferSettings.from_spec(load_job(manifest).spec), tmp_path / "wal").start()
    run_dir = tmp_path / "run"
    metrics = run_dir / "learner_metrics.jsonl"
    argv = [sys.executable, "-m", "stoker.cli", "learner", "--manifest", str(manifest),
            "--buffer", f"127.0.0.1:{server.port}", "--run-dir", str(run_dir), "--log-level", "warning"]

    def start(max_steps: int) -> list[subprocess.Popen[str]]:
        envs = process_envs(2, xla_cache_dir, heartbeat=HEARTBEAT_SECONDS)
        return [
            subprocess.Popen([*argv, "--max-steps", str(max_steps)], env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for env in envs
        ]

    groups = 40
    try:
        client = BufferClient(f"127.0.0.1:{server.port}")
        rng = np.random.default_rng(3)
        client.put([e for g in range(groups) for e in bandit_episodes(rng, f"g{g}")])  # type: ignore[misc]
        primary, peer = start(1000)
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and primary.poll() is None:
                done = metrics.read_text().count("\n") if metrics.exists() else 0
                ckpt = run_dir / "ckpt"
                if done >= 4 and ckpt.exists() and any(p.name.isdigit() for p in ckpt.iterdir()):
                    break
                time.sleep(0.05)  # polling the run's own files, not waiting out a race
            assert primary.poll() is None and peer.poll() is None, "a learner exited early"
            peer.kill()
            killed = time.monotonic()
            output = primary.communicate(timeout=HEARTBEAT_SECONDS + 60)[0]
            survived_for = time.monotonic() - killed
        finally:
            for proc in (primary, peer):
                proc.kill()
                proc.wait(timeout=30)
        # The survivor ends non-zero within the bound: at its next collective (gloo sees the closed
        # connection), or -- waiting on something else, e.g. Orbax's barrier -- when the
        # coordination service misses the peer's heartbeats.
        assert primary.returncode not in (0, None), output[-3000:]
        assert survived_for < HEARTBEAT_SECONDS + 30, survived_for
        reasons = ("another process failed", "JAX distributed service detected fatal errors")
        assert any(reason in output for reason in reasons), output[:6000]
        killed_at = max(json.loads(x)["policy_version"] for x in metrics.read_text().splitlines())
        saved = max(int(p.name) for p in (run_dir / "ckpt").iterdir() if p.name.isdigit())
        before = client.stats()
        assert before.leased_batches >= 1  # the batch the primary had in flight when the peer died

        target = saved + 3
        restarted = start(target)
        finish(restarted, timeout=240)
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
        versions, steps = [r["policy_version"] for r in records], [r["step"] for r in records]
        assert steps[-3:] == [saved + 1, saved + 2, saved + 3]  # resumed from the checkpoint
        assert versions == sorted(set(versions)) and versions[-3] > killed_at  # monotonic, never reused
        after = client.stats()
        assert after.policy_version == versions[-1]
        # The leased batch came back to the queue (the restarted learner is a new session) ...
        # (The restarted learner's own last prefetched batch is still leased: a stopped learner
        # leaves it for redelivery, as on one process.)
        assert after.redelivered_groups >= before.redelivered_groups + 2 * before.leased_batches
        # ... and nothing was lost: every trajectory is committed or still waiting, once.
        assert after.committed_total + after.stored_trajectories == groups * GROUP_SIZE
        assert after.committed_groups_total - before.committed_groups_total == 3 * 2
    finally:
        server.stop()
