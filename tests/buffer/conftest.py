"""Shared fixtures for the buffer tests: episode factories and a running in-process server."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.buffer.client import BufferClient
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import encode_trajectory
from stoker.trajectory import Episode
from stoker.v1 import trajectory_pb2

_ids = itertools.count()

EpisodeFactory = Callable[..., Episode]


def _episode(
    group_id: str = "",
    *,
    episode_id: str = "",
    group_size: int = 2,
    tokens: int = 8,
    version: int = 0,
    status: int = trajectory_pb2.EPISODE_STATUS_OK,
    actor_id: str = "actor-0",
) -> Episode:
    n = next(_ids)
    mask = np.ones(tokens, np.uint8)
    mask[: tokens // 4] = 0  # a prompt
    return Episode(
        episode_id=episode_id or f"ep-{n}",
        group_id=group_id or f"group-{n}",
        group_size=group_size,
        task_id="task",
        token_ids=np.arange(tokens, dtype=np.int32),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
        policy_versions=np.where(mask == 1, version, -1).astype(np.int32),
        reward=1.0,
        status=status,
        actor_id=actor_id,
    )


@pytest.fixture
def make_episode() -> EpisodeFactory:
    """``make_episode(group_id, group_size=2, tokens=8, version=0, status=OK, ...)``"""
    return _episode


@pytest.fixture
def make_group() -> Callable[..., list[Episode]]:
    """``make_group(size=2, **episode_kwargs)``: every episode of one fresh group."""

    def make(size: int = 2, **kwargs: Any) -> list[Episode]:
        group_id = f"group-{next(_ids)}"
        return [_episode(group_id, group_size=size, **kwargs) for _ in range(size)]

    return make


@pytest.fixture
def raw() -> Callable[[Episode], bytes]:
    return encode_trajectory


@pytest.fixture
def settings() -> BufferSettings:
    return BufferSettings(group_size=2, capacity=64, max_staleness=2, batch_groups=2)


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., BufferServer]]:
    """Start in-process servers on loopback (stopped at teardown)."""
    started: list[BufferServer] = []

    def start(settings: BufferSettings, data_dir: Path | None = None, **kwargs: Any) -> BufferServer:
        server = BufferServer(settings, data_dir or tmp_path / "data", host="127.0.0.1", port=0, **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace=0)


@pytest.fixture
def buffer(server_factory: Callable[..., BufferServer], settings: BufferSettings) -> Iterator[BufferClient]:
    """A client of a fresh in-process buffer (``settings`` fixture)."""
    server = server_factory(settings)
    with BufferClient(f"127.0.0.1:{server.port}", client_id="test") as client:
        client.wait_ready(10)
        yield client


class BufferProcess:
    """``stoker buffer`` as a real subprocess; ready once it has written its ready file."""

    def __init__(self, data_dir: Path, work: Path, *extra: str, group_size: int = 2, capacity: int = 4096):
        import json
        import subprocess
        import sys

        self.ready = work / f"ready-{next(_ids)}"
        manifest = work / "job.yaml"
        manifest.write_text(
            json.dumps(
                {
                    "apiVersion": "stoker.dev/v1alpha1",
                    "kind": "RLJob",
                    "spec": {"buffer": {"groupSize": group_size, "capacity": capacity, "maxStaleness": 100}},
                }
            )
        )
        command = [
            sys.executable, "-m", "stoker.cli", "buffer", "--host", "127.0.0.1", "--port", "0",
            "--data-dir", str(data_dir), "--manifest", str(manifest), "--ready-file", str(self.ready),
            "--log-format", "text", *extra,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self.port = self._wait_ready(30.0)
        self.address = f"127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> int:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready.exists():
                return int(self.ready.read_text())
            if self.process.poll() is not None:
                raise RuntimeError(f"buffer exited with {self.process.returncode}: {self.process.stderr.read()}")  # type: ignore[union-attr]
            time.sleep(0.02)  # polling the ready file the server writes once it serves
        raise RuntimeError("buffer not ready in time")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush."""
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(10)


@pytest.fixture
def buffer_process(tmp_path: Path) -> Iterator[Callable[..., BufferProcess]]:
    started: list[BufferProcess] = []

    def start(data_dir: Path | None = None, *extra: str, **kwargs: Any) -> BufferProcess:
        process = BufferProcess(data_dir or tmp_path / "data", tmp_path, *extra, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.process.poll() is None:
            process.kill()
        if process.process.stderr:
            process.process.stderr.close()
