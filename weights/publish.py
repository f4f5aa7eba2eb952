"""Sharded publishing: every learner process writes (or serves) only the shards its devices hold.

``ShardedPublisher.publish(version, model)`` runs on every process, on the outbox's thread, over a
``Trainer.policy_copy`` in the parameters' training sharding (no gather). Each distinct shard
(replicas deduplicated: one holder per box, spread over the processes that hold a copy) is read
from its device to the host one at a time, transposed to Hugging Face's layout, checksummed and
written to the shared directory and/or kept for this process's ``ShardServer``. A process then
posts its part (checksums, its server's address) to the JAX coordination service's key-value
store; the primary waits for every part, with a deadline, then commits the manifest. The barrier
is the key-value store rather than a device collective, so it never interleaves with the training
thread's collectives. A process that dies mid-publish posts no part: the version is never
committed, the previous one stays served, and the next commit prunes the partial folder.
Format and commit: docs/architecture.md, "Sharded weights".
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax._src.distributed import global_state

from stoker.endpoints import UNIX_SCHEME
from stoker.distributed import Processes, broadcast_int
from stoker.model.hf import hf_name, param_items
from stoker.weights.shard_service import ShardServer
from stoker.weights.shard_stream import StreamServer, staged_lookup, stream_address
from stoker.weights.shards import (
    BLOCK_BYTES, LATEST_FILE, Box, ShardDirectory, ShardManifest, ShardRecord, TensorRecord, block_rows, checksums,
    folder_name, fsync_file,
)

log = logging.getLogger(__name__)

KV_PREFIX = "stoker/weights"
WRITERS = 4  # shards staged at once per process (the host's staging bound is this many shards)
COMMIT_TIMEOUT_SECONDS = 600.0  # how long the primary waits for every process's part of a version


@dataclass(frozen=True)
class PlannedShard:
    name: str  # HF name
    key: str
    box: Box  # HF layout
    device: Any  # the device whose copy is published
    transpose: bool
    array: Any  # the global jax.Array it is a shard of


@dataclass
class PublishStats:
    """This process's side of its last publish (what the tests and the benchmark read)."""

    version: int = -1
    shards: int = 0
    bytes_written: int = 0  # bytes of shards this process staged (to the directory and/or its server)
    peak_staging_bytes: int = 0  # the most bytes of shards held on the host at once while staging (<= writers shards)
    seconds: float = 0.0


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def plan(model: Any) -> tuple[list[PlannedShard], dict[str, tuple[tuple[int, ...], str]]]:
    """Every distinct shard of ``model``'s parameters and who publishes it, the same on every
    process (computed from the shardings alone), and each tensor's HF shape and dtype."""
    shards: list[PlannedShard] = []
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for t, (path, var) in enumerate(param_items(model)):
        name, transpose = hf_name(path)
        array = var.get_value()
        shape = tuple(array.shape)
        holders: dict[Box, list[Any]] = {}
        for device, index in array.sharding.devices_indices_map(shape).items():
            holders.setdefault(_box(index, shape), []).append(device)
        tensors[name] = (tuple(reversed(shape)) if transpose else shape, str(array.dtype))
        for i, (box, devices) in enumerate(sorted(holders.items())):
            devices.sort(key=lambda d: d.id)
            owner = devices[(t + i) % len(devices)]  # spread replicated tensors over their holders
            hf_box = tuple(reversed(box)) if transpose else box
            shards.append(PlannedShard(name, f"{name}@{i}", hf_box, owner, transpose, array))
    return shards, tensors


def _device_transpose(data: Any) -> Any:
    return jnp.transpose(data)


def advertised(address: str, port: int) -> str:
    """The address other pods reach this process's server at: the bound host, or the pod's IP
    (``POD_IP``, from the downward API; else the host name's address) for a wildcard bind."""
    if address.startswith(UNIX_SCHEME):
        return address  # a unix socket is reached by its path, on this host
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


class ShardedPublisher:
    """Publishes sharded versions from every learner process (every process constructs one, in
    the same order: the run id is agreed with a broadcast). ``directory``: the shared volume's
    path; ``address``: serve this process's shards there (``host:port``), the bytes also over a
    plain-TCP stream on ``stream_port`` (0: a free one) of the same host unless ``stream`` is false. At least one."""

    every_process = True  # the learner's loop hands it to every process, not only the primary

    def __init__(
        self,
        *,
        directory: str | None = None,
        address: str | None = None,
        keep: int = 2,
        auth_token: str | None = None,
        processes: Processes | None = None,
        commit_timeout_s: float = COMMIT_TIMEOUT_SECONDS,
        block_bytes: int = BLOCK_BYTES,
        writers: int = WRITERS,
        stream: bool = True,
        stream_port: int = 0,
    ):
        if directory is None and address is None:
            raise ValueError("ShardedPublisher needs a directory, an address, or both")
        self.processes = processes or Processes.current()
        self.keep = keep
        self.commit_timeout_s = commit_timeout_s
        self.block_bytes = block_bytes
        self.writers = max(1, writers)
        self.directory = ShardDirectory(directory, keep) if directory is not None else None
        if self.directory is not None:
            self.directory.directory.mkdir(parents=True, exist_ok=True)
        self.server: ShardServer | None = None
        self.address: str | None = None
        self.stream: StreamServer | None = None  # the plain-TCP stream of the same staged shards (bulk bytes)
        self.stream_address: str | None = None
        if address is not None:
            self.server = ShardServer(address, keep=keep, auth_token=auth_token)
            self.address = advertised(address, self.server.port)
            if stream:
                lookup = staged_lookup(self.server.servicer.array)
                self.stream = StreamServer(stream_address(address, stream_port), lookup, token=auth_token)
                bound = self.stream.address
                self.stream_address = bound.target if bound.is_unix else advertised(address, bound.port)
        self.run = self._agree_run_id()
        self.stats = PublishStats()
        self._latest = -1
        self._lock = threading.Lock()

    @property
    def latest_version(self) -> int:
        return self._latest

    @property
    def port(self) -> int | None:
        return None if self.server is None else int(self.server.port)

    def held_bytes(self) -> int:
        """Host memory this process's server holds for readers (its shards of ``keep`` versions)."""
        return 0 if self.server is None else int(self.server.servicer.held_bytes())

    def _agree_run_id(self) -> str:
        mine = secrets.randbits(62)
        return f"{broadcast_int(self.processes, mine):016x}"

    def publish(self, version: int, model: Any) -> ShardManifest | None:
        """Stage this process's shards of ``model`` (an nnx module over a ``policy_copy``) as
        ``version``; on the primary, commit once every process has. Returns the committed manifest
        (primary) or None."""
        with self._lock:
            if version <= self._latest:
                raise ValueError(f"version {version} is not newer than the published {self._latest}")
            started = time.perf_counter()
            shards, tensors = plan(model)
            me = self.processes.index
            folder = folder_name(version, self.run)
            stats = PublishStats(version)
            mine = [shard for shard in shards if shard.device.process_index == me]
            part = self._stage(version, folder, mine, stats)
            parts = self._exchange(version, part)
            manifest = None
            if parts is not None:
                manifest = self._manifest(version, folder, shards, tensors, parts)
                if self.directory is not None:
                    self.directory.commit(manifest, LATEST_FILE)
                if self.server is not None:
                    self.server.servicer.commit(manifest)
                log.info("published weights v%d: %d tensors, %d bytes in shards", version, len(tensors), manifest.nbytes)
            stats.seconds = time.perf_counter() - started
            self.stats = stats
            self._latest = version
            return manifest

    def _stage(self, version: int, folder: str, mine: list[PlannedShard], stats: PublishStats) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Stage ``mine`` over ``writers`` threads, at most ``writers`` shards on the host at once
        (device-to-host copy, crc32 and the file write all let go of the GIL); the directory's
        files are written unsynced and fsynced together at the end, so write-back overlaps."""
        part: dict[str, tuple[int, tuple[int, ...]]] = {}
        written: list[Path] = []
        me, lock, held = self.processes.index, threading.Lock(), [0]
        local: dict[int, dict[Any, Any]] = {}
        for shard in mine:  # on this thread: jax.Array's shard lookup is not worth racing over
            local.setdefault(id(shard.array), {s.device: s.data for s in shard.array.addressable_shards})

        def stage_one(shard: PlannedShard) -> None:
            data = local[id(shard.array)][shard.device]
            # The layout change runs on the shard's own device (a program of one shard's size),
            # so the host only copies contiguous bytes.
            host = np.asarray(_device_transpose(data) if shard.transpose else data)
            with lock:
                held[0] += int(host.nbytes)
                stats.peak_staging_bytes = max(stats.peak_staging_bytes, held[0])
            try:
                rows = block_rows(host.shape, host.dtype.itemsize, self.block_bytes)
                crc = checksums(host, rows)
                path = None
                if self.directory is not None:
                    path = self.directory.write_shard(folder, me, shard.key, host, sync=False)
                if self.server is not None:
                    self.server.servicer.stage(version, shard.key, host)
            finally:
                with lock:
                    held[0] -= int(host.nbytes)
            with lock:
                part[shard.key] = (rows, crc)
                if path is not None:
                    written.append(path)
                stats.shards += 1
                stats.bytes_written += int(host.nbytes)

        with futures.ThreadPoolExecutor(max_workers=self.writers, thread_name_prefix="weights-stage") as pool:
            pending: list[futures.Future[None]] = []
            for shard in mine:
                if len(pending) >= self.writers:  # bound what is staged on the host at once
                    pending.pop(0).result()
                pending.append(pool.submit(stage_one, shard))
            for future in pending:
                future.result()
            list(pool.map(fsync_file, written))
        return part

    def _exchange(self, version: int, part: dict[str, tuple[int, tuple[int, ...]]]) -> list[dict[str, Any]] | None:
        """Post this process's part; the primary gets every process's (the barrier), others None."""
        mine = {"address": self.address, "stream": self.stream_address, "shards": {k: [rows, list(crc)] for k, (rows, crc) in part.items()}}
        if not self.processes.multi:
            return [mine]
        client = global_state.client
        assert client is not None, "jax.distributed is not initialized"
        prefix = f"{KV_PREFIX}/{self.run}/{version:012d}"
        client.key_value_set(f"{prefix}/{self.processes.index}", json.dumps(mine))
        if not self.processes.primary:
            return None
        deadline = time.monotonic() + self.commit_timeout_s
        parts = []
        for process in range(self.processes.count):
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                parts.append(json.loads(client.blocking_key_value_get(f"{prefix}/{process}", left_ms)))
            except Exception as exc:  # noqa: BLE001 - the coordination service's errors are untyped
                raise RuntimeError(
                    f"weights v{version}: learner process {process} did not finish publishing its shards "
                    f"within {self.commit_timeout_s:.0f} s ({exc}); the version stays unpublished"
                ) from exc
        for process in range(self.processes.count):
            client.key_value_delete(f"{prefix}/{process}")
        return parts

    def _manifest(
        self, version: int, folder: str, shards: list[PlannedShard],
        tensors: dict[str, tuple[tuple[int, ...], str]], parts: list[dict[str, Any]],
    ) -> ShardManifest:
        records: dict[str, list[ShardRecord]] = {name: [] for name in tensors}
        for shard in shards:
            process = shard.device.process_index
            rows, crc = parts[process]["shards"][shard.key]
            records[shard.name].append(ShardRecord(shard.box, process, shard.key, int(rows), tuple(crc)))
        peers = tuple(str(p["address"]) for p in parts) if self.server is not None else ()
        streams = tuple(str(p.get("stream") or "") for p in parts) if any(p.get("stream") for p in parts) else ()
        return ShardManifest(
            version, folder, self.processes.count,
            {name: TensorRecord(name, shape, dtype, tuple(records[name])) for name, (shape, dtype) in tensors.items()},
            peers, streams,
        )

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self.server is not None:
            self.server.close()
            self.server = None

    def __enter__(self) -> ShardedPublisher:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
