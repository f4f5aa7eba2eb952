"""Pod sandboxes against a fake Kubernetes API whose "kubelet" runs the manifest's container
command as a local process: creation, readiness, heartbeat annotations, deletion, a dying pod."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stoker import labels
from stoker.actor.environments import StepLatency
from stoker.actor.episode import FAILED, OK, EpisodeLimits, run_group
from stoker.actor.pods import WORKDIR, pod_factory
from stoker.actor.policy import ScriptedPolicy
from stoker.actor.sandbox import SandboxConfig
from stoker.actor.settings import PodSandboxSettings
from stoker.conversation.tokenization import TextInterface

pytestmark = pytest.mark.asyncio


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeCoreV1:
    """Just enough of CoreV1Api; each pod's container runs as a local subprocess."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.heartbeats: list[str] = []
        self.deleted: list[str] = []

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        [container] = body["spec"]["containers"]
        workdir = tempfile.mkdtemp(prefix="fake-pod-")
        args = [a.replace("0.0.0.0", "127.0.0.1") for a in container["args"]]
        env = {e["name"]: e["value"].replace(WORKDIR, workdir) for e in container["env"]}
        env["PATH"] = os.environ["PATH"]
        command = [sys.executable, *container["command"][1:], *args]
        self.processes[name] = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.DEVNULL)
        self.pods[name] = body

    def read_namespaced_pod(self, name: str, namespace: str) -> Any:
        from kubernetes.client.exceptions import ApiException

        if name not in self.pods:
            raise ApiException(status=404, reason="Not Found")
        process = self.processes[name]
        port = int(next(a for a in self.pods[name]["spec"]["containers"][0]["args"] if a.startswith("--port="))[7:])
        terminated = None
        if process.poll() is not None:
            reason = "OOMKilled" if process.returncode == -signal.SIGKILL else "Error"
            terminated = SimpleNamespace(exit_code=128 - process.returncode, reason=reason)
        ready = terminated is None and _accepts(port)
        return SimpleNamespace(
            status=SimpleNamespace(
                phase="Running" if terminated is None else "Failed",
                pod_ip="127.0.0.1",
                conditions=[SimpleNamespace(type="Ready", status="True" if ready else "False")],
                container_statuses=[SimpleNamespace(state=SimpleNamespace(terminated=terminated))],
            )
        )

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.heartbeats.append(body["metadata"]["annotations"][labels.HEARTBEAT_ANNOTATION])

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int = 30) -> None:
        self.pods.pop(name, None)
        process = self.processes.pop(name)
        process.kill()
        process.wait()
        self.deleted.append(name)


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def core() -> Any:
    api = FakeCoreV1()
    yield api
    for process in api.processes.values():
        process.kill()
        process.wait()


def pod_settings() -> PodSandboxSettings:
    return PodSandboxSettings(namespace="rl", job="demo", actor_pod="demo-actor-0", image="x", port=free_port())


async def test_pod_sandbox_episode_heartbeats_and_is_deleted(
    core: FakeCoreV1, lake: TextInterface, lake_config: SandboxConfig, lake_expert
) -> None:  # type: ignore[no-untyped-def]
    config = dataclasses.replace(lake_config, heartbeat_seconds=0.05, step_latency=StepLatency("fixed", 0.1))
    limits = EpisodeLimits(max_turns=10)
    [episode] = await run_group(ScriptedPolicy(lake_expert), pod_factory(config, pod_settings(), core), lake, "1", 1, limits=limits)
    assert episode.status == OK and episode.metrics["success"] == 1.0
    assert len(core.heartbeats) >= 2  # the annotation the operator's reaper reads was refreshed
    assert all(labels.parse_rfc3339(h) for h in core.heartbeats)
    assert len(core.deleted) == 1 and not core.pods  # the pod is gone with its episode


async def test_pod_that_dies_fails_the_episode_with_its_reason(
    core: FakeCoreV1, lake: TextInterface, lake_config: SandboxConfig
) -> None:
    vocab = lake.tokenizer.get_vocab()
    turns = 0

    def respond(_: Any) -> list[int]:
        nonlocal turns
        turns += 1
        if turns == 2:
            next(iter(core.processes.values())).send_signal(signal.SIGKILL)
        return [vocab["G"]]

    [episode] = await run_group(
        ScriptedPolicy(respond), pod_factory(lake_config, pod_settings(), core), lake, "1", 1, limits=EpisodeLimits()
    )
    assert episode.status == FAILED and "pod exited" in episode.status_reason and "OOMKilled" in episode.status_reason
    assert not core.pods
