"""The weight channel: the learner publishes versioned weights, actors pull the newest.

A version's payload is one safetensors blob of Hugging Face-named arrays (``flatten_params``), with
its sha256 (``stoker.weights.blob_format``). Two transports, usable together:

* gRPC (``stoker.v1.Weights``): ``Latest`` answers version/size/sha256; ``Fetch`` streams the
  blob in chunks (each gRPC message stays far below the 4 MiB default limit).
* a shared directory (a PersistentVolume, or a local path; ``stoker.weights.blob_directory``):
  written atomically, so a reader never sees a half-written version under a final name.

Either way the subscriber checks size and sha256 before decoding, so truncated or corrupted
weights raise ``WeightsCorrupt`` instead of loading silently wrong.

A learner of several processes publishes sharded instead (``stoker.weights.shards``,
``stoker.weights.publish``): ``Latest`` says so, and ``fetch`` returns ``ShardedWeights``, read by
slice (crc32 per block) from the directory or from every learner process's server.

Only the newest ``keep`` versions are retained; fetching a pruned one raises ``WeightsNotFound``
(ask for the latest again).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent import futures
from pathlib import Path
from types import TracebackType

import grpc
import numpy as np
from flax import nnx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stoker.channels import channel_options
from stoker.endpoints import add_grpc_port, parse
from stoker.model.hf import load_hf, to_hf
from stoker.v1 import weights_pb2, weights_pb2_grpc
from stoker.weights.blob_directory import BlobDirectory, blob_file_name, blob_manifest_name, read_info
from stoker.weights.blob_format import Blob, WeightsInfo, decode_weights, encode_weights
from stoker.weights.errors import WeightsCorrupt, WeightsError, WeightsNotFound, WeightsUnavailable
from stoker.weights.grpc_common import DEFAULT_CHUNK_BYTES, GRPC_OPTIONS, BearerAuth
from stoker.weights.relay_source import RelayedSource
from stoker.weights.shard_relay import WeightRelay
from stoker.weights.shard_service import PeerShards
from stoker.weights.shard_stream import StreamShards
from stoker.weights.shards import LATEST_FILE, ShardDirectory, ShardedWeights, ShardSource

log = logging.getLogger(__name__)


def flatten_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's parameters as host arrays under Hugging Face names (see ``stoker.model.hf``)."""
    return to_hf(model)


def load_flat(model: nnx.Module, flat: Mapping[str, np.ndarray]) -> None:
    """Inverse of ``flatten_params``: overwrite the model's parameters in place."""
    load_hf(model, flat)


class _WeightsServicer(weights_pb2_grpc.WeightsServicer):
    def __init__(self, chunk_bytes: int):
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._blobs: OrderedDict[int, Blob] = OrderedDict()

    def put(self, blob: Blob, keep: int) -> None:
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
        self._store = BlobDirectory(Path(directory), keep) if directory is not None else None
        self._servicer: _WeightsServicer | None = None
        self._server: grpc.Server | None = None
        self.port: int | None = None
        if address is not None:
            interceptors = [BearerAuth(auth_token)] if auth_token else []
            self._server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="weights"),
                interceptors=interceptors,
                options=GRPC_OPTIONS,
            )
            self._servicer = _WeightsServicer(chunk_bytes)
            weights_pb2_grpc.add_WeightsServicer_to_server(self._servicer, self._server)
            self._health = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
            # 0 on a unix socket
            self.port = add_grpc_port(self._server, parse(address, where="weights server address"), where="weights server").port
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
        relay: WeightRelay | None = None,
        stream: bool = True,
    ):
        if (address is None) == (directory is None):
            raise ValueError("WeightSubscriber needs exactly one of address and directory")
        # Sharded reads go through this relay (other rollout servers first; what is read is served on).
        self.relay = relay
        # Sharded bytes over the learner processes' plain-TCP streams where the manifest names
        # them (stoker.weights.shard_stream), gRPC ReadShard as their fallback.
        self.stream = stream
        self._token = auth_token
        self._streams: StreamShards | None = None
        self.timeout_s = timeout_s
        self._directory = Path(directory) if directory is not None else None
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._address = address
        self._channel: grpc.Channel | None = None
        self._stub: weights_pb2_grpc.WeightsStub | None = None
        self._sharded = False  # what the server's last Latest said
        self._peers: PeerShards | None = None  # once a sharded version was fetched over gRPC
        if address is not None:
            self._channel = grpc.insecure_channel(address, options=channel_options(GRPC_OPTIONS))
            self._stub = weights_pb2_grpc.WeightsStub(self._channel)

    def latest(self) -> WeightsInfo | None:
        """The newest published version's info, or None before the first publish."""
        if self._directory is not None:
            return read_info(self._directory / LATEST_FILE)
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
        assert self._address is not None
        if self._peers is None:
            self._peers = PeerShards(self._metadata, self.timeout_s)
        manifest = self._peers.manifest(self._address, version)
        source: ShardSource = self._peers
        if self.stream and manifest.streams:
            if self._streams is None:
                self._streams = StreamShards(self._token, self._peers, timeout_s=self.timeout_s)
            source = self._streams
        return ShardedWeights(manifest, self._relayed(source))

    def _relayed(self, source: ShardSource) -> ShardSource:
        return source if self.relay is None else RelayedSource(self.relay, source)

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
        info = read_info(self._directory / blob_manifest_name(version))
        if info is None:
            shards = ShardDirectory(self._directory)
            manifest = shards.manifest(version)
            if manifest is not None:
                return ShardedWeights(manifest, self._relayed(shards))
            raise WeightsNotFound(f"policy version {version} is not in {self._directory}")
        try:
            data = (self._directory / blob_file_name(version)).read_bytes()
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


def make_weight_source(target: str, token: str | None = None) -> WeightSubscriber:
    """A subscriber for ``target``: a shared directory (a path) or the learner's weights server
    (an address), as ``--weights`` names it on actors and rollout servers."""
    if Path(target).is_dir() or target.startswith(("/", ".", "~")):
        return WeightSubscriber(directory=Path(target).expanduser())
    return WeightSubscriber(address=target, auth_token=token)
