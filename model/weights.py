"""The weight channel: the learner publishes versioned weights, actors pull the newest.

A version's payload is one safetensors blob of Hugging Face-named arrays (``flatten_params``), with
its sha256. Two transports, usable together:

* gRPC (``stoker.v1.Weights``): ``Latest`` answers version/size/sha256; ``Fetch`` streams the
  blob in chunks (each gRPC message stays far below the 4 MiB default limit).
* a shared directory (a PersistentVolume, or a local path): each version is written to a temporary
  name, fsynced and renamed, then its manifest and the ``LATEST.json`` pointer are renamed in the
  same way, so a reader never sees a half-written version under a final name.

Either way the subscriber checks size and sha256 before decoding, so truncated or corrupted
weights raise ``WeightsCorrupt`` instead of loading silently wrong.

A learner of several processes publishes sharded instead (``stoker.model.shards``,
``stoker.learner.publish``): ``Latest`` says so, and ``fetch`` returns ``ShardedWeights``, read by
slice (crc32 per block) from the directory or from every learner process's server.

Only the newest ``keep`` versions are retained; fetching a pruned one raises ``WeightsNotFound``
(ask for the latest again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from flax import nnx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stoker.channels import channel_options
from stoker.model.hf import CheckpointError, decode_safetensors, encode_safetensors, load_hf, to_hf
from stoker.model.shards import FORMAT as SHARDS_FORMAT
from stoker.model.shards import ShardDirectory, ShardedWeights
from stoker.model.weight_errors import WeightsCorrupt, WeightsError, WeightsNotFound, WeightsUnavailable
from stoker.v1 import weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
LATEST_FILE = "LATEST.json"
# Room for one chunk plus framing, and for large subscribers' Latest calls.
_GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def flatten_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's parameters as host arrays under Hugging Face names (see ``stoker.model.hf``)."""
    return to_hf(model)


def load_flat(model: nnx.Module, flat: Mapping[str, np.ndarray]) -> None:
    """Inverse of ``flatten_params``: overwrite the model's parameters in place."""
    load_hf(model, flat)


@dataclass(frozen=True)
class WeightsInfo:
    version: int
    sha256: str
    size_bytes: int
    sharded: bool = False  # a ``stoker.model.shards`` manifest rather than one blob


@dataclass(frozen=True)
class _Blob:
    info: WeightsInfo
    data: bytes


def encode_weights(version: int, flat: Mapping[str, np.ndarray]) -> _Blob:
    data = encode_safetensors(flat, metadata={"policy_version": str(version)})
    return _Blob(WeightsInfo(version, hashlib.sha256(data).hexdigest(), len(data)), data)


def decode_weights(info: WeightsInfo, data: bytes) -> dict[str, np.ndarray]:
    """Check ``data`` against ``info`` and decode it."""
    if len(data) != info.size_bytes:
        raise WeightsCorrupt(f"version {info.version}: got {len(data)} bytes, expected {info.size_bytes}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise WeightsCorrupt(f"version {info.version}: sha256 {digest[:12]}... != published {info.sha256[:12]}...")
    try:
        return decode_safetensors(data)
    except CheckpointError as err:
        raise WeightsCorrupt(f"version {info.version}: {err}") from err


# ------------------------------------------------------------------------------- directory


def _weights_name(version: int) -> str:
    return f"weights-{version:012d}.safetensors"


def _manifest_name(version: int) -> str:
    return f"weights-{version:012d}.json"


def _atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _info_json(info: WeightsInfo) -> bytes:
    return json.dumps(
        {"policy_version": info.version, "sha256": info.sha256, "size_bytes": info.size_bytes,
         "file": _weights_name(info.version)}
    ).encode()


def _read_info(path: Path) -> WeightsInfo | None:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as err:
        raise WeightsCorrupt(f"{path} is not valid JSON: {err}") from err
    try:
        return WeightsInfo(
            int(raw["policy_version"]), str(raw["sha256"]), int(raw["size_bytes"]), raw.get("format") == SHARDS_FORMAT
        )
    except (KeyError, TypeError, ValueError) as err:
        raise WeightsCorrupt(f"{path} is not a weights manifest: {err}") from err


class _DirectoryStore:
    def __init__(self, directory: Path, keep: int):
        self.directory = directory
        self.keep = keep
        directory.mkdir(parents=True, exist_ok=True)

    def write(self, blob: _Blob) -> None:
        version = blob.info.version
        _atomic_write(self.directory / _weights_name(version), blob.data)
        manifest = _info_json(blob.info)
        _atomic_write(self.directory / _manifest_name(version), manifest)
        _atomic_write(self.directory / LATEST_FILE, manifest)
        self._prune(version)

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep`` versions up to ``newest``. Versions above it are left over
        from an earlier run that got further before it was rolled back to a checkpoint: they are
        no longer this run's history, so they go too."""
        versions = sorted(
            int(p.name[len("weights-") : -len(".json")]) for p in self.directory.glob("weights-*.json")
        )
        retained = [v for v in versions if v <= newest][-self.keep :]
        for version in versions:
            if version not in retained:
                # Manifest first: a reader that finds no manifest never opens the blob.
                (self.directory / _manifest_name(version)).unlink(missing_ok=True)
                (self.directory / _weights_name(version)).unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ gRPC


class _BearerAuth(grpc.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        if handler_call_details.method.startswith("/grpc.health."):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if metadata.get("authorization") != self._expected:
            return self._deny
        return continuation(handler_call_details)


class _WeightsServicer(weights_pb2_grpc.WeightsServicer):
    def __init__(self, chunk_bytes: int):
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._blobs: OrderedDict[int, _Blob] = OrderedDict()

    def put(self, blob: _Blob, keep: int) -> None:
        with self._lock:
            self._blobs[blob.info.version] = blob
            while len(self._blobs) > keep:
                self._blobs.popitem(last=False)

    def Latest(self, request: weights_pb2.LatestRequest, context: grpc.ServicerContext) -> weights_pb2.WeightsInfo:
        with self._lock:
            if not self._blobs:
                return weights_pb2.WeightsInfo(policy_version=-1)
            info = next(reversed(self._blobs.values())).info
        return weights_pb2.WeightsInfo(policy_version=info.version, size_bytes=info.size_bytes, sha256=info.sha256)

    def Fetch(
        self, request: weights_pb2.FetchRequest, context: grpc.ServicerContext
    ) -> Iterator[weights_pb2.WeightsChunk]:
        with self._lock:
            blob = self._blobs.get(request.policy_version)
        if blob is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"policy version {request.policy_version} is not retained")
            return
        view = memoryview(blob.data)
        info = blob.info
        for offset in range(0, max(info.size_bytes, 1), self._chunk_bytes):
            chunk = weights_pb2.WeightsChunk(
                policy_version=info.version, offset=offset, data=bytes(view[offset : offset + self._chunk_bytes])
            )
            if offset == 0:
                chunk.size_bytes = info.size_bytes
                chunk.sha256 = info.sha256
            yield chunk


class WeightPublisher:
    """Learner side: ``publish(version, flat)`` makes a version available to subscribers.

    ``directory``: write each version into this shared directory. ``address`` (e.g.
    ``"0.0.0.0:50052"``, port 0 picks a free one): serve ``stoker.v1.Weights`` there. At least one
    is required. ``keep``: versions retained for subscribers still fetching an older one.
    """

    def __init__(
        self,
        *,
        directory: str | Path | None = None,
        address: str | None = None,
        keep: int = 2,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        auth_token: str | None = None,
        max_workers: int = 8,
    ):
        if directory is None and address is None:
            raise ValueError("WeightPublisher needs a directory, an address, or both")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._latest = -1
        self._publish_lock = threading.Lock()
        self._store = _DirectoryStore(Path(directory), keep) if directory is not None else None
        self._servicer: _WeightsServicer | None = None
        self._server: grpc.Server | None = None
        self.port: int | None = None
        if address is not None:
            interceptors = [_BearerAuth(auth_token)] if auth_token else []
            self._server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="weights"),
                interceptors=interceptors,
                options=_GRPC_OPTIONS,
            )
            self._servicer = _WeightsServicer(chunk_bytes)
            weights_pb2_grpc.add_WeightsServicer_to_server(self._servicer, self._server)
            self._health = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
            self.port = self._server.add_insecure_port(address)
            if self.port == 0:
                raise OSError(f"cannot bind the weights server to {address}")
            self._server.start()
            self._health.set("stoker.v1.Weights", health_pb2.HealthCheckResponse.SERVING)
            self._health.set("", health_pb2.HealthCheckResponse.SERVING)

    @property
    def latest_version(self) -> int:
        return self._latest

    def publish(self, version: int, flat: Mapping[str, np.ndarray]) -> WeightsInfo:
        """Encode once, then hand the same bytes to every transport. Versions must increase."""
        with self._publish_lock:
            if version <= self._latest:
                raise ValueError(f"version {version} is not newer than the published {self._latest}")
            blob = encode_weights(version, flat)
            if self._store is not None:
                self._store.write(blob)
            if self._servicer is not None:
                self._servicer.put(blob, self.keep)
            self._latest = version
        log.info("published weights v%d (%d bytes)", version, blob.info.size_bytes)
        return blob.info

    def close(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class WeightSubscriber:
    """Actor side: ``latest_version()`` and ``fetch(version)`` against a publisher's gRPC
    ``address`` ("host:port") or its shared ``directory`` (exactly one)."""

    def __init__(
        self,
        *,
        address: str | None = None,
        directory: str | Path | None = None,
        auth_token: str | None = None,
        timeout_s: float = 120.0,
        relay: Any = None,
        stream: bool = True,
    ):
        if (address is None) == (directory is None):
            raise ValueError("WeightSubscriber needs exactly one of address and directory")
        # A ``stoker.model.shard_relay.WeightRelay``: sharded reads go through it (other rollout
        # servers first, what is read is served on).
        self.relay = relay
        # Sharded bytes over the learner processes' plain-TCP streams where the manifest names
        # them (stoker.model.shard_stream), gRPC ReadShard as their fallback.
        self.stream = stream
        self._token = auth_token
        self._streams: Any = None
        self.timeout_s = timeout_s
        self._directory = Path(directory) if directory is not None else None
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._address = address
        self._channel: grpc.Channel | None = None
        self._stub: weights_pb2_grpc.WeightsStub | None = None
        self._sharded = False  # what the server's last Latest said
        self._peers: Any = None  # a PeerShards, once a sharded version was fetched over gRPC
        if address is not None:
            self._channel = grpc.insecure_channel(address, options=channel_options(_GRPC_OPTIONS))
            self._stub = weights_pb2_grpc.WeightsStub(self._channel)

    def latest(self) -> WeightsInfo | None:
        """The newest published version's info, or None before the first publish."""
        if self._directory is not None:
            return _read_info(self._directory / LATEST_FILE)
        assert self._stub is not None
        try:
            reply = self._stub.Latest(weights_pb2.LatestRequest(), timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise self._translate(err) from err
        if reply.policy_version < 0:
            return None
        self._sharded = reply.sharded
        return WeightsInfo(reply.policy_version, reply.sha256, reply.size_bytes, reply.sharded)

    def latest_version(self) -> int:
        """The newest published version, -1 before the first publish."""
        info = self.latest()
        return -1 if info is None else info.version

    def fetch(self, version: int) -> Mapping[str, np.ndarray]:
        """One version's HF-named arrays, verified against its published size and sha256; a
        sharded version as ``ShardedWeights`` (read lazily, by slice, crc32-checked)."""
        if self._directory is not None:
            return self._fetch_directory(version)
        if self._sharded:
            return self._fetch_sharded(version)
        return self._fetch_grpc(version)

    def _fetch_sharded(self, version: int) -> ShardedWeights:
        from stoker.model.shard_service import PeerShards

        assert self._address is not None
        if self._peers is None:
            self._peers = PeerShards(self._metadata, self.timeout_s)
        manifest = self._peers.manifest(self._address, version)
        source: Any = self._peers
        if self.stream and manifest.streams:
            from stoker.model.shard_stream import StreamShards

            if self._streams is None:
                self._streams = StreamShards(self._token, self._peers, timeout_s=self.timeout_s)
            source = self._streams
        return ShardedWeights(manifest, self._relayed(source))

    def _relayed(self, source: Any) -> Any:
        return source if self.relay is None else self.relay.source(source)

    def fetch_latest(self) -> tuple[int, Mapping[str, np.ndarray]] | None:
        """(version, arrays) of the newest version, or None before the first publish. Retries
        once if the newest version is pruned between the two calls."""
        for _ in range(2):
            info = self.latest()
            if info is None:
                return None
            try:
                return info.version, self.fetch(info.version)
            except WeightsNotFound:
                continue
        raise WeightsUnavailable("the latest version kept being replaced while fetching")

    def _fetch_directory(self, version: int) -> Mapping[str, np.ndarray]:
        assert self._directory is not None
        info = _read_info(self._directory / _manifest_name(version))
        if info is None:
            shards = ShardDirectory(self._directory)
            manifest = shards.manifest(version)
            if manifest is not None:
                return ShardedWeights(manifest, self._relayed(shards))
            raise WeightsNotFound(f"policy version {version} is not in {self._directory}")
        try:
            data = (self._directory / _weights_name(version)).read_bytes()
        except FileNotFoundError as err:
            raise WeightsNotFound(f"policy version {version} was pruned from {self._directory}") from err
        return decode_weights(info, data)

    def _fetch_grpc(self, version: int) -> Mapping[str, np.ndarray]:
        assert self._stub is not None
        parts: list[bytes] = []
        info: WeightsInfo | None = None
        received = 0
        try:
            for chunk in self._stub.Fetch(
                weights_pb2.FetchRequest(policy_version=version), timeout=self.timeout_s, metadata=self._metadata
            ):
                if info is None:
                    info = WeightsInfo(chunk.policy_version, chunk.sha256, chunk.size_bytes)
                if chunk.offset != received:
                    raise WeightsCorrupt(f"version {version}: chunk at offset {chunk.offset}, expected {received}")
                parts.append(chunk.data)
                received += len(chunk.data)
        except grpc.RpcError as err:
            if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._sharded = True  # a sharded publisher (fetched before any Latest)
                return self._fetch_sharded(version)
            raise self._translate(err) from err
        if info is None:
            raise WeightsCorrupt(f"version {version}: empty stream")
        if info.version != version:
            raise WeightsCorrupt(f"asked for version {version}, received {info.version}")
        # One join (no incremental buffer): the payload is copied once before hashing/decoding.
        return decode_weights(info, b"".join(parts))

    @staticmethod
    def _translate(err: grpc.RpcError) -> WeightsError:
        code = err.code() if isinstance(err, grpc.Call) else None
        detail = err.details() if isinstance(err, grpc.Call) else str(err)
        if code == grpc.StatusCode.NOT_FOUND:
            return WeightsNotFound(detail or "not found")
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return WeightsError(f"the weights server refused our token: {detail}")
        return WeightsUnavailable(f"weights server: {code.name if code else 'error'}: {detail}")

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._peers is not None:
            self._peers.close()
            self._peers = None
        if self._streams is not None:
            self._streams.close()
            self._streams = None

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
