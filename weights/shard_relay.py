"""Relayed sharded weights: a rollout server that reads a version passes the blocks it holds on
to other rollout servers, so the learner sends each version out about once however many servers
read it (a chain or tree of relays). Each relay is a pipeline stage: a block is served on as soon
as it has arrived and matched its crc32, while the rest of the version is still coming.

``WeightRelay`` (one per rollout server): ``serve(address)`` runs ``ReadShard`` over the blocks
this server has read, waiting (up to ``wait_s``) for blocks it is still reading;
``RelayedSource(relay, primary)`` (``stoker.weights.relay_source``) is the ``ShardSource`` its own
reads go through: the relays it reads from (``upstream``) first, then ``primary`` (the learner's
servers or the shared directory) for whatever they cannot give: a block that relay is not reading
(another layout), or a relay that dies, stalls or sends a bad block mid-transfer. The reader keeps the verified blocks it has and asks the next source for the
rest. Every block is checked against the manifest's crc32 before it is used or passed on.

Upstream relays are either fixed (``upstream``) or, with ``registry`` (the learner's primary
weights server) and ``advertise`` (where this relay is reached), asked for per version: the
first time a reader of a version says which blocks it will read, it registers them and its
address and is told whom to read from (``Relays`` RPC, stoker.weights.relay_registry).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from stoker.channels import channel_options
from stoker.v1 import weights_pb2, weights_pb2_grpc
from stoker.weights.grpc_common import GRPC_OPTIONS, BearerAuth
from stoker import endpoints
from stoker.weights.shard_stream import Progressive, StreamServer, StreamShards, stream_address
from stoker.weights.shards import BlockGeometry, ShardManifest, ShardRecord, ShardsCorrupt, geometry

log = logging.getLogger(__name__)

WAIT_SECONDS = 60.0  # how long a relay holds a request for a block it is still reading


@dataclass
class _Held:
    manifest: ShardManifest
    shards: dict[str, ShardRecord]
    blocks: dict[tuple[str, int], memoryview | bytes] = field(default_factory=dict)  # views of the read buffers
    planned: set[tuple[str, int]] = field(default_factory=set)


class RelayCache:
    """The verified blocks of the newest ``keep`` versions this server read or is reading."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._cond = threading.Condition()
        self._versions: OrderedDict[int, _Held] = OrderedDict()

    def _held(self, manifest: ShardManifest) -> _Held:
        held = self._versions.get(manifest.version)
        if held is None:
            shards = {s.key: s for t in manifest.tensors.values() for s in t.shards}
            held = self._versions[manifest.version] = _Held(manifest, shards)
            while len(self._versions) > self.keep:
                self._versions.popitem(last=False)
        return held

    def expect(self, manifest: ShardManifest, blocks: Iterable[tuple[str, int]]) -> None:
        """This server is about to read ``blocks`` of ``manifest``: requests for them wait."""
        with self._cond:
            self._held(manifest).planned.update(blocks)
            self._cond.notify_all()

    def put(self, manifest: ShardManifest, key: str, block: int, data: memoryview | bytes) -> None:
        """Block ``block`` of ``key``, verified: kept as it is (a view of the reader's buffer, not
        copied; nothing writes a verified block again)."""
        with self._cond:
            self._held(manifest).blocks[(key, block)] = data
            self._cond.notify_all()

    def give_up(self, version: int, key: str, blocks: Iterable[int]) -> None:
        """Blocks this server failed to read: requests for them stop waiting (and fall back)."""
        with self._cond:
            held = self._versions.get(version)
            if held is not None:
                held.planned.difference_update((key, b) for b in blocks if (key, b) not in held.blocks)
            self._cond.notify_all()

    def shard(self, version: int, key: str, deadline: float) -> tuple[ShardManifest, ShardRecord] | None:
        """The manifest and record of ``key``, waiting until ``deadline`` for the version to start."""
        with self._cond:
            while True:
                held = self._versions.get(version)
                if held is not None:
                    record = held.shards.get(key)
                    return None if record is None else (held.manifest, record)
                if not self._cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    return None

    def block(self, version: int, key: str, block: int, deadline: float) -> memoryview | bytes | None:
        """Block ``block`` of ``key`` once this server has it; None if it is not reading it,
        gave up on it, dropped the version, or ``deadline`` passed."""
        with self._cond:
            while True:
                held = self._versions.get(version)
                if held is None:
                    return None
                data = held.blocks.get((key, block))
                if data is not None:
                    return data
                if (key, block) not in held.planned:
                    return None
                if not self._cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    return None

    def held_bytes(self) -> int:
        with self._cond:
            return sum(len(d) for held in self._versions.values() for d in held.blocks.values())


def held_pieces(cache: RelayCache, version: int, key: str, shape: BlockGeometry, offset: int, size: int,
                wait_s: float) -> Iterator[memoryview | bytes]:
    """Bytes ``offset..offset + size`` of ``key`` block by block as this server gets them; stops
    early at a block it will not have (not reading it, gave up, or ``wait_s`` passed for it)."""
    end = offset + size
    for block in range(offset // shape.block_bytes, max(end - 1, offset) // shape.block_bytes + 1):
        data = cache.block(version, key, block, time.monotonic() + wait_s)
        if data is None:
            return
        start, _ = shape.span(block)
        lo, hi = max(offset, start) - start, min(end, start + len(data)) - start
        yield data if (lo, hi) == (0, len(data)) else data[lo:hi]


class _RelayServicer(weights_pb2_grpc.WeightsServicer):
    def __init__(self, cache: RelayCache, wait_s: float, served: dict[str, int], lock: threading.Lock):
        self.cache, self.wait_s, self.served, self.lock = cache, wait_s, served, lock

    def ReadShard(self, request: weights_pb2.ReadShardRequest, context: grpc.ServicerContext) -> Iterator[weights_pb2.WeightsChunk]:
        deadline = time.monotonic() + self.wait_s
        found = self.cache.shard(request.policy_version, request.key, deadline)
        if found is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"this relay is not reading {request.key} of version {request.policy_version}")
            return
        shape = geometry(*found)
        end = request.offset + request.size
        if end > shape.total_bytes:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"bytes {request.offset}..{end} of a {shape.total_bytes}-byte shard")
            return
        sent = 0
        for data in held_pieces(self.cache, request.policy_version, request.key, shape, request.offset, request.size, self.wait_s):
            with self.lock:
                self.served["bytes"] += len(data)
            # protobuf takes bytes only: the gRPC path (the stream's fallback) pays this copy
            yield weights_pb2.WeightsChunk(policy_version=request.policy_version, offset=sent, data=bytes(data))
            sent += len(data)
        if sent < request.size:
            context.abort(grpc.StatusCode.NOT_FOUND, f"this relay does not hold {request.key} past byte {request.offset + sent}")


@dataclass
class RelayStats:
    """Bytes this server's reads took from each source ("relay <address> stream" over the relay's
    shard stream, "relay <address>" over its gRPC, or "primary"), how many times a source failed
    mid-read, and the bytes it served to other servers (over gRPC; its stream server counts its own)."""

    taken: dict[str, int] = field(default_factory=dict)
    fallbacks: int = 0
    upstream: dict[int, tuple[str, ...]] = field(default_factory=dict)  # per version, as the registry answered
    served: dict[str, int] = field(default_factory=lambda: {"bytes": 0})


class WeightRelay:
    """One rollout server's relay: what it reads is served on; it reads from ``upstream`` first."""

    def __init__(self, upstream: tuple[str, ...] = (), *, keep: int = 2, auth_token: str | None = None,
                 wait_s: float = WAIT_SECONDS, timeout_s: float = 120.0,
                 registry: str | None = None, advertise: str | None = None,
                 upstream_streams: dict[str, str] | None = None, stream_port: int | None = 0):
        if (registry is None) != (advertise is None):
            raise ValueError("a relay registers with both the learner's address and its own advertised address")
        self.upstream = upstream
        self.registry, self.advertise = registry, advertise
        # A relay's gRPC address -> its shard-stream address (read first; its gRPC, then the next
        # source, if the stream fails). Filled from the registry's answers too.
        self.streams_of: dict[str, str] = dict(upstream_streams or {})
        self.stream_port = stream_port  # serve() also serves the blocks over the stream here (0: free; None: off)
        self.stream_server: StreamServer | None = None
        self.stream_client: StreamShards | None = None
        self.cache = RelayCache(keep)
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self.auth_token = auth_token
        self.stats = RelayStats()
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, Any]] = {}
        self._server: Any = None
        self.port: int | None = None

    def serve(self, address: str, max_workers: int = 32) -> int:
        """Serve ``ReadShard`` from this server's blocks at ``address`` (port 0 picks one)."""
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="weight-relay"),
            interceptors=[BearerAuth(self.auth_token)] if self.auth_token else [], options=GRPC_OPTIONS,
        )
        weights_pb2_grpc.add_WeightsServicer_to_server(
            _RelayServicer(self.cache, self.wait_s, self.stats.served, self._lock), self._server
        )
        wanted = endpoints.parse(address, where="weight relay address")
        self.port = endpoints.add_grpc_port(self._server, wanted, where="weight relay").port  # 0 on a unix socket
        self._server.start()
        if self.stream_port is not None:
            self.stream_server = StreamServer(stream_address(address, self.stream_port), self._stream_lookup, token=self.auth_token)
        return self.port

    def _stream_lookup(self, version: int, process: int, key: str) -> Any:
        found = self.cache.shard(version, key, time.monotonic() + self.wait_s)
        if found is None:
            return None
        shape = geometry(*found)
        return Progressive(shape.total_bytes, lambda o, n: held_pieces(self.cache, version, key, shape, o, n, self.wait_s))

    def stream_advertise(self) -> str:
        """Where readers reach this relay's stream: the advertised host, the stream's port."""
        if self.stream_server is None or self.advertise is None:
            return ""
        if self.stream_server.address.is_unix:
            return self.stream_server.address.target  # beside the relay's socket, on this host
        return f"{self.advertise.rsplit(':', 1)[0]}:{self.stream_server.port}"

    def receive(self, address: str, manifest: ShardManifest, shard: ShardRecord, offset: int, out: memoryview,
                landed: Any) -> None:
        """Read from the relay stream at ``address`` into ``out``, each verified block to ``landed``."""
        with self._lock:
            if self.stream_client is None:
                self.stream_client = StreamShards(self.auth_token, timeout_s=self.timeout_s)
            client = self.stream_client
        client.receive(address, manifest, shard, offset, out, landed)

    def _stub(self, address: str) -> Any:
        with self._lock:
            if address not in self._channels:
                channel = grpc.insecure_channel(address, options=channel_options(GRPC_OPTIONS))
                self._channels[address] = (channel, weights_pb2_grpc.WeightsStub(channel))
            return self._channels[address][1]

    def stream(self, address: str, manifest: ShardManifest, shard: ShardRecord, offset: int, size: int) -> Iterator[bytes]:
        request = weights_pb2.ReadShardRequest(policy_version=manifest.version, key=shard.key, offset=offset, size=size)
        received = 0
        for chunk in self._stub(address).ReadShard(request, timeout=self.timeout_s, metadata=self.metadata):
            if chunk.offset != received:
                raise ShardsCorrupt(f"{shard.key}: chunk at offset {chunk.offset}, expected {received}")
            received += len(chunk.data)
            yield chunk.data

    def discover(self, manifest: ShardManifest, blocks: list[tuple[str, int]]) -> tuple[str, ...]:
        """Register as a reader of ``blocks`` of ``manifest`` with the registry; the relays to read
        them from, nearest first (none if the registry cannot say: the primary serves it all)."""
        assert self.registry is not None and self.advertise is not None
        layout = hashlib.sha256("\n".join(f"{k}\t{b}" for k, b in sorted(blocks)).encode()).hexdigest()
        request = weights_pb2.RelaysRequest(policy_version=manifest.version, layout=layout, address=self.advertise,
                                            stream=self.stream_advertise())
        try:
            reply = self._stub(self.registry).Relays(request, timeout=min(self.timeout_s, 30.0), metadata=self.metadata)
        except grpc.RpcError as err:
            log.warning("weights relay: %s gave no relays for version %d (%s); reading from the learner",
                        self.registry, manifest.version, getattr(err, "details", lambda: err)())
            return ()
        found = tuple(a for a in reply.upstream if a != self.advertise)
        with self._lock:
            self.stats.upstream[manifest.version] = found
            if len(reply.upstream_streams) == len(reply.upstream):
                self.streams_of.update((a, s) for a, s in zip(reply.upstream, reply.upstream_streams, strict=True) if s)
        log.info("weights relay: version %d from %s", manifest.version, ", ".join(found) or "the learner")
        return found

    def fell_back(self) -> None:
        with self._lock:
            self.stats.fallbacks += 1

    def take(self, source: str, n: int) -> None:
        with self._lock:
            self.stats.taken[source] = self.stats.taken.get(source, 0) + n

    def close(self) -> None:
        if self.stream_server is not None:
            self.stream_server.close()
            self.stream_server = None
        if self.stream_client is not None:
            self.stream_client.close()
        if self._server is not None:
            self._server.stop(0.5).wait()
            self._server = None
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()

