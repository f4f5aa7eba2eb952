"""Peer serving of sharded weights: every learner process serves the shards it holds.

``ShardServer`` runs ``stoker.v1.Weights`` on one learner process: ``ReadShard`` streams byte
ranges of the shards this process staged, and on the primary ``Latest``/``Manifest`` answer the
newest committed version. Readers (``PeerShards``) take each shard from the process the manifest
names, so the bandwidth a version is fetched with grows with the learner's hosts; nothing passes
through the primary but the manifest.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stoker.channels import channel_options
from stoker.endpoints import add_grpc_port, parse
from stoker.v1 import weights_pb2, weights_pb2_grpc
from stoker.weights.errors import WeightsCorrupt, WeightsError, WeightsUnavailable
from stoker.weights.grpc_common import DEFAULT_CHUNK_BYTES, GRPC_OPTIONS, BearerAuth
from stoker.weights.relay_registry import RelayRegistry
from stoker.weights.shards import ShardManifest, ShardRecord, ShardsMissing, as_bytes


class _ShardServicer(weights_pb2_grpc.WeightsServicer):
    def __init__(self, keep: int, chunk_bytes: int):
        self.keep = keep
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._staged: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._manifests: OrderedDict[int, tuple[ShardManifest, bytes]] = OrderedDict()
        self.served_bytes = 0  # shard bytes sent to readers (this process's egress)
        self.relays = RelayRegistry()  # answered on the primary, the server readers ask first

    def stage(self, version: int, key: str, array: np.ndarray) -> None:
        with self._lock:
            if version not in self._staged:
                self._staged[version] = {}
                while len(self._staged) > self.keep:  # the oldest version's readers get NOT_FOUND
                    self._staged.popitem(last=False)
            self._staged[version][key] = np.ascontiguousarray(array)

    def array(self, version: int, key: str) -> np.ndarray | None:
        """A staged shard (what the plain-TCP stream serves), or None once pruned."""
        with self._lock:
            return self._staged.get(version, {}).get(key)

    def commit(self, manifest: ShardManifest) -> None:
        with self._lock:
            self._manifests[manifest.version] = (manifest, manifest.to_json())
            while len(self._manifests) > self.keep:
                self._manifests.popitem(last=False)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for shards in self._staged.values() for a in shards.values())

    def Latest(self, request: weights_pb2.LatestRequest, context: grpc.ServicerContext) -> weights_pb2.WeightsInfo:
        with self._lock:
            if not self._manifests:
                return weights_pb2.WeightsInfo(policy_version=-1)
            manifest, data = next(reversed(self._manifests.values()))
        return weights_pb2.WeightsInfo(
            policy_version=manifest.version, size_bytes=manifest.nbytes, sha256=hashlib.sha256(data).hexdigest(),
            sharded=True,
        )

    def Fetch(self, request: weights_pb2.FetchRequest, context: grpc.ServicerContext) -> Iterator[weights_pb2.WeightsChunk]:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "these weights are sharded: use Manifest and ReadShard")
        yield from ()

    def Manifest(self, request: weights_pb2.FetchRequest, context: grpc.ServicerContext) -> weights_pb2.ShardManifest:
        with self._lock:
            found = self._manifests.get(request.policy_version)
        if found is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"policy version {request.policy_version} is not retained")
            raise AssertionError("abort raises")
        return weights_pb2.ShardManifest(manifest=found[1])

    def Relays(self, request: weights_pb2.RelaysRequest, context: grpc.ServicerContext) -> weights_pb2.RelaysReply:
        try:
            upstream = self.relays.join(request.policy_version, request.layout, request.address, request.stream)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise AssertionError("abort raises") from err
        streams = self.relays.streams(request.policy_version, upstream)
        return weights_pb2.RelaysReply(upstream=upstream, upstream_streams=streams)

    def ReadShard(self, request: weights_pb2.ReadShardRequest, context: grpc.ServicerContext) -> Iterator[weights_pb2.WeightsChunk]:
        with self._lock:
            array = self._staged.get(request.policy_version, {}).get(request.key)
        if array is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"shard {request.key} of version {request.policy_version} is not held here")
            return
        view = as_bytes(array)
        end = request.offset + request.size
        if end > len(view):
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"bytes {request.offset}..{end} of a {len(view)}-byte shard")
            return
        for at in range(request.offset, max(end, request.offset + 1), self.chunk_bytes):
            data = bytes(view[at : min(at + self.chunk_bytes, end)])
            with self._lock:
                self.served_bytes += len(data)
            yield weights_pb2.WeightsChunk(policy_version=request.policy_version, offset=at - request.offset, data=data)


class ShardServer:
    """The weights server of one learner process (``address``: ``host:port``, port 0 picks one)."""

    def __init__(self, address: str, *, keep: int = 2, auth_token: str | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_workers: int = 16):
        self.servicer = _ShardServicer(keep, chunk_bytes)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="weight-shards"),
            interceptors=[BearerAuth(auth_token)] if auth_token else [], options=GRPC_OPTIONS,
        )
        weights_pb2_grpc.add_WeightsServicer_to_server(self.servicer, self._server)
        checks = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, self._server)
        # 0 on a unix socket
        self.port = add_grpc_port(self._server, parse(address, where="weights server address"), where="weights server").port
        self._server.start()
        for service in ("", "stoker.v1.Weights"):
            checks.set(service, health_pb2.HealthCheckResponse.SERVING)

    def close(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait()


def translate(err: grpc.RpcError) -> WeightsError:
    """A failed shard read's gRPC error as the weight channel's error (NOT_FOUND: pruned)."""
    code = err.code() if isinstance(err, grpc.Call) else None
    detail = err.details() if isinstance(err, grpc.Call) else str(err)
    if code == grpc.StatusCode.NOT_FOUND:
        return ShardsMissing(detail or "not found")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return WeightsError(f"the weights server refused our token: {detail}")
    return WeightsUnavailable(f"weights server: {code.name if code else 'error'}: {detail}")


class PeerShards:
    """Reads shards from the learner process that holds each (``ShardSource``), one channel per
    peer, reused across versions."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), timeout_s: float = 120.0):
        self.metadata = metadata
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, Any]] = {}

    def _stub(self, address: str) -> Any:
        with self._lock:
            if address not in self._stubs:
                channel = grpc.insecure_channel(address, options=channel_options(GRPC_OPTIONS))
                self._stubs[address] = (channel, weights_pb2_grpc.WeightsStub(channel))
            return self._stubs[address][1]

    def manifest(self, address: str, version: int) -> ShardManifest:
        try:
            reply = self._stub(address).Manifest(
                weights_pb2.FetchRequest(policy_version=version), timeout=self.timeout_s, metadata=self.metadata
            )
        except grpc.RpcError as err:
            raise translate(err) from err
        return ShardManifest.from_json(reply.manifest)

    def read(self, manifest: ShardManifest, shard: ShardRecord, offset: int, size: int) -> bytes:
        return b"".join(self.stream(manifest, shard, offset, size))

    def stream(self, manifest: ShardManifest, shard: ShardRecord, offset: int, size: int) -> Iterator[bytes]:
        """The bytes of ``read``, chunk by chunk as they arrive (a relay passes them on)."""
        if shard.process >= len(manifest.peers):
            raise WeightsCorrupt(f"the manifest names no server for learner process {shard.process}")
        received = 0
        request = weights_pb2.ReadShardRequest(policy_version=manifest.version, key=shard.key, offset=offset, size=size)
        try:
            for chunk in self._stub(manifest.peers[shard.process]).ReadShard(request, timeout=self.timeout_s, metadata=self.metadata):
                if chunk.offset != received:
                    raise WeightsCorrupt(f"{shard.key}: chunk at offset {chunk.offset}, expected {received}")
                received += len(chunk.data)
                yield chunk.data
        except grpc.RpcError as err:
            raise translate(err) from err

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()
