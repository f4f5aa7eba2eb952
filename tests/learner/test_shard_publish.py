"""Sharded weights over real JAX processes (jax.distributed on loopback, gloo): learner processes
on an fsdp x tp mesh each publish only their own shards; rollout processes with another tp read
only their devices' slices, from the learners' own servers or the shared directory; a learner
killed mid-publish leaves the previous version served and the partial one invisible."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.weights.channel import WeightsNotFound, WeightSubscriber
from stoker.weights.publish import WRITERS

WORKER = Path(__file__).with_name("shards_worker.py")
sys.path.insert(0, str(WORKER.parent))
from shards_worker import CONFIG, reference  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(role: str, out: Path, processes: int, cache: Path, *extra: str) -> list[subprocess.Popen[str]]:
    if role == "learn" and not (out / "checkpoint").exists():
        import jax.numpy as jnp

        from stoker.model.hf import save_checkpoint
        from stoker.model.model import init_model
        from stoker.spec import TransformerConfig

        save_checkpoint(init_model(TransformerConfig(**CONFIG), 0, jnp.bfloat16), out / "checkpoint")
    env = {
        **os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "STOKER_NUM_PROCESSES": str(processes), "STOKER_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "STOKER_HEARTBEAT_TIMEOUT_SECONDS": "10",
    }
    argv = [sys.executable, str(WORKER), role, str(out), *extra]
    return [
        subprocess.Popen(argv, env={**env, "STOKER_PROCESS_ID": str(i)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(processes)
    ]


def finish(procs: list[subprocess.Popen[str]], timeout: float = 300) -> list[str]:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for i, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {i} exited {proc.returncode}:\n{output[-4000:]}"
    return outputs


def wait_for(paths: list[Path], procs: list[subprocess.Popen[str]], timeout: float = 300) -> None:
    """Until every path exists; fails at once if a process ends first."""
    import time

    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.poll() is not None and not all(p.exists() for p in paths):
                raise AssertionError(f"a worker exited {proc.returncode} early:\n{proc.communicate()[0][-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_learners_publish_their_own_shards_and_rollout_hosts_with_another_tp_read_only_their_slices(
    tmp_path: Path, xla_cache_dir: Path
) -> None:
    learners = start("learn", tmp_path, 2, xla_cache_dir, "--devices", "2", "--mesh", "2x2")
    try:
        wait_for([tmp_path / f"learn-{i}.json" for i in range(2)], learners)
        # Two rollout hosts, tp=4 over both (not the learners' 2x2), from the learners' servers;
        # and one host with tp=2 from the shared directory.
        finish(start("read", tmp_path / "", 2, xla_cache_dir, "--devices", "2", "--tp", "4", "--source", "grpc"))
        peer_reads = [json.loads((tmp_path / f"read-{i}.json").read_text()) for i in range(2)]
        for f in tmp_path.glob("read-*.json"):
            f.unlink()
        finish(start("read", tmp_path, 1, xla_cache_dir, "--devices", "2", "--tp", "2", "--source", "dir"))
        dir_read = json.loads((tmp_path / "read-0.json").read_text())
    finally:
        (tmp_path / "readers-done").touch()
    finish(learners)
    learned = [json.loads((tmp_path / f"learn-{i}.json").read_text()) for i in range(2)]
    want = reference(2)
    total = sum(a.nbytes for a in want.values())
    replicated = sum(a.nbytes for a in want.values() if a.ndim < 2 or a.size < 2**14)  # sharding.MIN_SHARDED_SIZE

    for stats in learned:
        # The random init and a checkpoint load land in the training sharding, each process
        # placing only its devices' slices, bit-exact.
        assert stats["init_in_place"] and stats["checkpoint_in_place"]
        assert stats["copy_keeps_training_sharding"]
        for version in ("1", "2"):
            v = stats["versions"][version]
            # Its share of the sharded tensors (a quarter per device, two devices) plus at most the small
            # replicated ones, of which each process writes only some (replicas deduplicated).
            assert v["bytes_written"] <= total // 2 + replicated, (stats["process"], v)
            # At most WRITERS shards (each at most a quarter of a tensor) on the host at once.
            assert v["peak_staging_bytes"] <= WRITERS * (max(a.nbytes for a in want.values()) // 4 + 1)
        assert stats["held_bytes"] <= 2 * stats["versions"]["2"]["bytes_written"]  # keep=2 versions of its own share
    # Every byte of the model written exactly once over the processes, and both processes wrote some.
    assert sum(s["versions"]["2"]["bytes_written"] for s in learned) == total
    assert min(s["versions"]["2"]["bytes_written"] for s in learned) > total // 4

    for result in [*peer_reads, dir_read]:
        assert result["equal"] and result["version"] == 2, result
        assert result["shards_checked"] > 0
        # Exactly the slices its devices hold, never the rest of the model.
        assert result["bytes_needed"] <= result["bytes_read"] <= result["bytes_needed"] + 4096, result
    for result in peer_reads:  # each tp=4 host holds half of every split tensor (k/v stay whole: 2 heads)
        assert result["bytes_read"] < 0.6 * total, result
        # Every byte over the learners' plain-TCP streams, none through gRPC's fallback.
        assert result["streamed_bytes"] == result["bytes_read"] and result["stream_fallbacks"] == 0, result
    assert dir_read["bytes_read"] == total  # one host with every device needs it all, once

    # A single-blob-era subscriber API sees the version and assembles a gathered copy, bit-exact.
    with WeightSubscriber(directory=tmp_path / "weights") as subscriber:
        gathered = subscriber.fetch(2)
        for name, array in want.items():
            assert gathered[name].dtype == array.dtype and gathered[name].tobytes() == array.tobytes(), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_learner_killed_mid_publish_leaves_the_previous_version_served_and_the_partial_one_invisible(
    tmp_path: Path, xla_cache_dir: Path
) -> None:
    learners = start("learn", tmp_path, 2, xla_cache_dir, "--devices", "1", "--mesh", "2x1", "--die-after", "2")
    outputs = [p.communicate(timeout=300)[0] for p in learners]
    assert learners[1].returncode == 17, outputs[1][-3000:]  # died after writing 2 shards of version 2
    # The primary never commits version 2: it waits for the dead process's part until the
    # coordination service ends it too (the JobSet then restarts the group), or until its deadline.
    assert learners[0].returncode != 0 and not (tmp_path / "learn-0.json").exists(), outputs[0][-3000:]
    weights = tmp_path / "weights"
    partial = [p for p in weights.glob("shards-000000000002-*") if p.is_dir()]
    assert partial and any(partial[0].rglob("*@*")), "the dead process's shards were written"
    with WeightSubscriber(directory=weights) as subscriber:
        assert subscriber.latest_version() == 1
        with pytest.raises(WeightsNotFound):
            subscriber.fetch(2)
        served = subscriber.fetch(1)
        for name, array in reference(1).items():
            assert served[name].tobytes() == array.tobytes(), name

    # The restarted learner's next commit removes the dead publish's folder.
    import jax.numpy as jnp

    from stoker.distributed import Processes
    from stoker.weights.publish import ShardedPublisher
    from stoker.model.model import init_model
    from stoker.spec import TransformerConfig
    with ShardedPublisher(directory=str(weights), processes=Processes()) as restarted:
        restarted.publish(3, init_model(TransformerConfig(**CONFIG), 0, jnp.bfloat16))
    assert not any(p.exists() for p in partial)
    with WeightSubscriber(directory=weights) as subscriber:
        assert subscriber.latest_version() == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_learner_processes_publish_sharded_from_the_training_loop(tmp_path: Path, xla_cache_dir: Path) -> None:
    """The loop's publishing over two processes: every version is published by both or neither
    (no process waits at a barrier the other skipped), reported after its commit, and the last
    one is the trained weights."""
    import numpy as np

    argv = [sys.executable, str(WORKER.with_name("multiprocess_worker.py")), str(tmp_path), "--devices", "1",
            "--steps", "3", "--mesh", "2x1", "--sharded"]
    env = {
        **os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(xla_cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "STOKER_NUM_PROCESSES": "2", "STOKER_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "STOKER_HEARTBEAT_TIMEOUT_SECONDS": "20",
    }
    finish([
        subprocess.Popen(argv, env={**env, "STOKER_PROCESS_ID": str(i)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ], timeout=500)
    run = json.loads((tmp_path / "2x1.json").read_text())
    other = json.loads((tmp_path / "2x1-process1.json").read_text())
    assert run["published"] == other["published"]  # both processes staged the same versions
    assert run["published"][0] == 0 and run["published"][-1] == 3
    assert run["versions"] == run["published"]  # each reported once, after its commit
    arrays = np.load(tmp_path / "2x1.npz")
    for name in (k[len("param/") :] for k in arrays.files if k.startswith("param/")):
        np.testing.assert_array_equal(arrays[f"published/{name}"], arrays[f"param/{name}"])
