"""One rollout server over two real JAX processes (jax.distributed on loopback, gloo collectives).

`stoker rollout` runs as two hosts of two CPU devices each, with the model split tensor-parallel
over all four: host 0 serves, host 1 replays its sampler calls. Concurrent multi-turn sessions
get exactly the tokens the split model samples, each log-prob matching a teacher-forced forward
under the version it reports while a new version is published mid-run; losing host 1 ends the
server and fails the turn in flight cleanly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from stoker.model.hf import to_hf
from stoker.model.model import init_model
from stoker.weights.channel import WeightPublisher
from stoker.spec import TransformerConfig
from stoker.v1 import rollout_pb2, rollout_pb2_grpc

from .conftest import teacher_forced

CONFIG = TransformerConfig(
    vocab_size=32, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64, max_seq_len=128
)
MANIFEST = """
apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {name: two-hosts}
spec:
  seed: 0
  model:
    architecture: {vocabSize: 32, hiddenSize: 32, numLayers: 1, numHeads: 4, numKvHeads: 2, intermediateSize: 64, maxSeqLen: 128}
  environment: {name: frozenlake}
  actors: {sampling: {temperature: 1.0}}
  learner: {sequenceBuckets: [128], compilationCacheDir: CACHE}
  rollout: {replicas: 1, maxBatch: 4, maxQueue: 64}
"""
EXIT_PEER_FAILED = 3
SESSIONS, TURNS, NEW_TOKENS = 6, 3, 6


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_hosts(tmp_path: Path, cache: Path, weights: Path) -> list[subprocess.Popen[str]]:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(MANIFEST.replace("CACHE", str(cache)))
    shared = {
        **os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "STOKER_NUM_PROCESSES": "2", "STOKER_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "STOKER_HEARTBEAT_TIMEOUT_SECONDS": "10",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    argv = [
        sys.executable, "-m", "stoker.cli", "rollout", "--manifest", str(manifest), "--host", "127.0.0.1",
        "--port", "0", "--mesh", "tp=4", "--weights", str(weights), "--log-level", "WARNING",
    ]
    return [
        subprocess.Popen(
            [*argv, *(["--ready-file", str(tmp_path / "ready")] if host == 0 else [])],
            env={**shared, "STOKER_PROCESS_ID": str(host)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )
        for host in range(2)
    ]


def wait_ready(ready: Path, hosts: list[subprocess.Popen[str]], timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        for host in hosts:
            if host.poll() is not None:
                raise AssertionError(f"a host exited {host.returncode}:\n{host.communicate()[0][-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("the two-host rollout server never became ready")
        time.sleep(0.2)  # polling for the server's ready file, not waiting out a race
    return int(ready.read_text())


class Conversation:
    """One multi-turn session: each turn sends everything so far plus a new observation."""

    def __init__(self, index: int):
        self.name, self.pinned = f"s{index}", index % 2 == 0
        self.rng = np.random.default_rng(index)
        self.context: list[int] = self.rng.integers(0, CONFIG.vocab_size, size=3 + index).tolist()
        self.turns: list[tuple[list[int], list[float], list[int]]] = []  # (sequence, log-probs, versions)

    def turn(self, stub: rollout_pb2_grpc.RolloutStub) -> None:
        answer = stub.Generate(
            rollout_pb2.GenerateRequest(
                prompt_ids=self.context, max_new_tokens=NEW_TOKENS, session=self.name, pin_weights=self.pinned
            ),
            timeout=300,
        )
        self.context = self.context + list(answer.token_ids)
        self.turns.append((list(self.context), list(answer.logprobs), list(answer.policy_versions)))
        self.context += self.rng.integers(0, CONFIG.vocab_size, size=2).tolist()


def every_turn(stub: rollout_pb2_grpc.RolloutStub, conversations: list[Conversation]) -> None:
    """One turn of every conversation, all at once (more than the server's batch)."""
    threads = [threading.Thread(target=c.turn, args=(stub,)) for c in conversations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_hosts_serve_one_split_model_exactly_and_fail_together(tmp_path: Path, xla_cache_dir: Path) -> None:
    publisher = WeightPublisher(directory=tmp_path / "weights")
    hosts = start_hosts(tmp_path, xla_cache_dir, tmp_path / "weights")
    try:
        port = wait_ready(tmp_path / "ready", hosts)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = rollout_pb2_grpc.RolloutStub(channel)
        conversations = [Conversation(i) for i in range(SESSIONS)]
        every_turn(stub, conversations)
        publisher.publish(1, to_hf(init_model(CONFIG, seed=1)))  # between two turns of every session
        deadline = time.monotonic() + 120
        while stub.Stats(rollout_pb2.RolloutStatsRequest()).policy_version < 1:
            assert time.monotonic() < deadline, "version 1 was never loaded on both hosts"
            time.sleep(0.2)  # polling the server's reported version
        for _ in range(TURNS - 1):
            every_turn(stub, conversations)
        for conversation in conversations:
            # Pinned sessions keep the weights they began with; the others move to version 1.
            later = 0 if conversation.pinned else 1
            assert [set(versions) for _, _, versions in conversation.turns] == [{0}] + [{later}] * (TURNS - 1)
            for sequence, logprobs, versions in conversation.turns:
                assert len(logprobs) == len(versions) == NEW_TOKENS  # no stop tokens: every turn runs out
                expected = teacher_forced(versions[0], [sequence], CONFIG)[0][-len(logprobs):]
                np.testing.assert_allclose(logprobs, expected, atol=2e-4)

        # Losing host 1 ends the server: the turn in flight fails UNAVAILABLE, and host 0 exits
        # with EXIT_PEER_FAILED (its JobSet restarts the slice) instead of serving a broken mesh.
        hosts[1].send_signal(signal.SIGKILL)
        hosts[1].wait(timeout=30)
        with pytest.raises(grpc.RpcError) as failed:
            stub.Generate(rollout_pb2.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=4), timeout=120)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        output = hosts[0].communicate(timeout=120)[0]
        assert hosts[0].returncode == EXIT_PEER_FAILED, output[-4000:]
        assert "another process failed" in output or "fatal errors" in output, output[-4000:]
        channel.close()
    finally:
        for host in hosts:
            if host.poll() is None:
                host.kill()
                host.communicate()
        publisher.close()
