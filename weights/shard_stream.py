"""Shard bytes over plain TCP, beside the gRPC weights service: no per-byte Python work.

gRPC keeps the control path (``Latest``, ``Manifest``, the fallback ``ReadShard``); the bulk
bytes go over this stream, which a sharded version's manifest names per learner process
(``ShardManifest.streams``). On the server the bytes leave by ``socket.sendall`` of the staged
array's own memory or by ``socket.sendfile`` from the shard's file; on the reader they land by
``recv_into`` in one preallocated buffer per read, each checksum block checked against the
manifest's crc32 as it completes (crc32 by ISA-L, outside the GIL, so other reads go on meanwhile).
gRPC's path copies every byte ~4 times in Python-visible buffers and builds a message per MiB;
measured side by side in benchmarks/README.md, "Sharded weights".

Wire format, one request after another on a connection:
    request: 4-byte big-endian length, then that many bytes of JSON
             {"token", "version", "process", "key", "offset", "size"}
    reply:   1 status byte and an 8-byte big-endian length; status OK: that many shard bytes,
             otherwise that many bytes of a UTF-8 reason (and the server closes the connection).

A dead, stalled or lying server (short, refused or wrong bytes) makes ``StreamShards`` keep the
blocks it verified and read the rest from its ``fallback`` (the gRPC peer, the directory); only a
refused token is final (the same token would be refused there too).
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoker import endpoints
from stoker.weights.errors import WeightsError, WeightsUnavailable
from stoker.weights.shards import (
    ShardDirectory, ShardManifest, ShardRecord, ShardsCorrupt, ShardsMissing, ShardSource, as_bytes, crc32, geometry,
)

log = logging.getLogger(__name__)

OK, NOT_FOUND, REFUSED, BAD_REQUEST = 0, 1, 2, 3
_REPLY = struct.Struct(">BQ")
_LENGTH = struct.Struct(">I")
MAX_REQUEST = 64 << 10
CONNECT_TIMEOUT_S = 10.0  # a firewalled stream port costs this once, then its reads go to the fallback
DEAD_FOR_S = 30.0  # how long a server we could not connect to is skipped
IDLE_S = 120.0  # a server closes a connection idle this long (readers reconnect)



@dataclass(frozen=True)
class Progressive:
    """A shard still arriving (a relay's blocks): ``pieces(offset, size)`` yields those bytes in
    order as they come, waiting for planned ones, and stops early if the rest will not come (the
    server then closes the connection mid-reply: the reader keeps what it verified and falls back)."""

    total: int  # the shard's bytes
    pieces: Callable[[int, int], Iterator[bytes | memoryview]]


# What a server sends for (version, process, key): the shard's bytes in memory, its file, or a
# relay's blocks as they arrive.
Served = memoryview | Path | Progressive
Lookup = Callable[[int, int, str], Served | None]


class StreamRefused(WeightsError):
    """The stream server refused our token."""


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        piece = conn.recv(n - len(data))
        if not piece:
            raise ConnectionError(f"connection closed after {len(data)} of {n} bytes")
        data += piece
    return bytes(data)


class StreamServer:
    """Serves shard byte ranges on ``address`` (``host:port``; port 0 picks one), one thread per
    connection. ``lookup`` finds what to send; ``token``: the bearer token readers must send."""

    def __init__(self, address: str, lookup: Lookup, *, token: str | None = None, idle_s: float = IDLE_S):
        self.lookup = lookup
        self.idle_s = idle_s
        self._token = token
        wanted = endpoints.parse(address, where="weight stream address")
        self._listener = endpoints.listen(wanted, where="weight stream address", backlog=128)
        self.address = endpoints.bound(self._listener, wanted)
        self.port = self.address.port  # 0 on a unix socket
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.served_bytes = 0  # shard bytes sent (this process's egress over the stream)
        self._acceptor = threading.Thread(target=self._accept, name="weight-stream-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            _no_delay(conn)
            conn.settimeout(self.idle_s)  # also bounds a send to a reader that stopped reading
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="weight-stream", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    head = conn.recv(_LENGTH.size, socket.MSG_WAITALL)
                except OSError:
                    return
                if len(head) < _LENGTH.size:
                    return  # the reader closed its connection
                (length,) = _LENGTH.unpack(head)
                if length > MAX_REQUEST:
                    return self._refuse(conn, BAD_REQUEST, f"a {length}-byte request")
                try:
                    request = json.loads(_recv_exact(conn, length))
                    token, version, process = request.get("token"), int(request["version"]), int(request["process"])
                    key, offset, size = str(request["key"]), int(request["offset"]), int(request["size"])
                except (ValueError, KeyError, TypeError, AttributeError) as err:
                    return self._refuse(conn, BAD_REQUEST, f"not a shard request: {err}")
                if self._token is not None and not hmac.compare_digest(str(token or ""), self._token):
                    return self._refuse(conn, REFUSED, "missing or wrong bearer token")
                served = self.lookup(version, process, key)
                if served is None:
                    return self._refuse(conn, NOT_FOUND, f"shard {key} of version {version} is not held here")
                total = served.stat().st_size if isinstance(served, Path) else served.total if isinstance(served, Progressive) else len(served)
                if offset < 0 or size < 0 or offset + size > total:
                    return self._refuse(conn, BAD_REQUEST, f"bytes {offset}..{offset + size} of a {total}-byte shard")
                conn.sendall(_REPLY.pack(OK, size))
                if isinstance(served, Progressive):
                    sent = 0
                    for piece in served.pieces(offset, size):
                        conn.sendall(piece)
                        sent += len(piece)
                        with self._lock:
                            self.served_bytes += len(piece)
                    if sent < size:
                        return  # the relay gave up on a block: closing tells the reader
                    continue
                if isinstance(served, Path):
                    with open(served, "rb") as f:
                        conn.sendfile(f, offset, size)
                else:
                    conn.sendall(served[offset : offset + size])
                with self._lock:
                    self.served_bytes += size
        except (OSError, FileNotFoundError):
            return  # the reader went away, or the file was pruned under us: the reader falls back
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    @staticmethod
    def _refuse(conn: socket.socket, status: int, reason: str) -> None:
        data = reason.encode()
        conn.sendall(_REPLY.pack(status, len(data)) + data)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        try:  # closing alone leaves a thread blocked in accept() on Linux; shutdown wakes it
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._acceptor.join(timeout=5.0)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def directory_lookup(directory: ShardDirectory) -> Lookup:
    """Serve a shared directory's committed shard files (``sendfile``)."""
    folders: dict[int, str] = {}

    def lookup(version: int, process: int, key: str) -> Served | None:
        if version not in folders:
            manifest = directory.manifest(version)
            if manifest is None:
                return None
            folders[version] = manifest.folder
        path = directory.directory / folders[version] / f"p{process:05d}" / key
        return path if path.is_file() else None

    return lookup


class StreamShards:
    """``ShardSource`` over the learner processes' stream servers (``manifest.streams``), with
    ``fallback`` for whatever a stream cannot give. Every block it returns was checked against
    its crc32 (``verifies_blocks``: the reader does not check it again). Reads must cover whole
    blocks, as ``ShardedWeights`` and the relay ask."""

    verifies_blocks = True

    def __init__(self, token: str | None = None, fallback: ShardSource | None = None, *, timeout_s: float = 120.0):
        self.token = token
        self.fallback = fallback
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        self._dead: dict[str, float] = {}  # address: until when (monotonic) it is not tried
        self.fallbacks = 0  # reads a stream could not finish
        self.streamed_bytes = 0  # verified bytes that came over a stream

    def read(self, manifest: ShardManifest, shard: ShardRecord, offset: int, size: int) -> memoryview:
        buffer: Any = np.empty(size, np.uint8)  # not zeroed: every byte is received or read before use
        out = memoryview(buffer)
        self.read_into(manifest, shard, offset, out)
        return out

    def read_into(self, manifest: ShardManifest, shard: ShardRecord, offset: int, out: memoryview) -> None:
        """``read`` into the caller's buffer (``len(out)`` bytes at ``offset``)."""
        shape = geometry(manifest, shard)
        step, total = shape.block_bytes, shape.total_bytes
        size = len(out)
        if offset % step or (size % step and offset + size != total):
            raise ValueError(f"{shard.key}: stream reads cover whole checksum blocks (offset {offset}, size {size})")
        good = [0]  # bytes verified so far, block by block
        failure: Exception | None = None
        address = manifest.streams[shard.process] if shard.process < len(manifest.streams) else ""
        with self._lock:
            if address and self._dead.get(address, 0.0) > time.monotonic():
                address = ""
        if address:
            try:
                self._receive(address, manifest, shard, offset, out, step, good)
                with self._lock:
                    self.streamed_bytes += size
                return
            except StreamRefused:
                raise
            except (OSError, WeightsError) as err:
                failure = err
                with self._lock:
                    self.fallbacks += 1
                    self.streamed_bytes += good[0]
                log.info("weights stream %s failed on %s after %d of %d bytes (%s); reading on from %s",
                         address, shard.key, good[0], size, err, "the fallback" if self.fallback else "nowhere")
        if self.fallback is None:
            raise failure if failure is not None else WeightsUnavailable(f"no stream server for learner process {shard.process}")
        into = getattr(self.fallback, "read_into", None)
        if into is not None:
            into(manifest, shard, offset + good[0], out[good[0]:])
        else:
            rest = self.fallback.read(manifest, shard, offset + good[0], size - good[0])
            if len(rest) != size - good[0]:
                raise ShardsCorrupt(f"{shard.key}: the fallback gave {len(rest)} of {size - good[0]} bytes")
            out[good[0]:] = memoryview(rest).cast("B")
        _verify(shard, out, offset // step, step, good[0], size)

    def receive(self, address: str, manifest: ShardManifest, shard: ShardRecord, offset: int, out: memoryview,
                landed: Callable[[memoryview], None]) -> None:
        """Read ``len(out)`` bytes at ``offset`` of ``shard`` from the stream server at ``address``
        (a relay) into ``out`` (the caller's buffer, 1-D bytes), no fallback: each block's view of
        ``out`` goes to ``landed`` as soon as it matched its crc32, so a failure (raised) leaves the
        caller holding every verified block before it."""
        step = geometry(manifest, shard).block_bytes
        with self._lock:
            if self._dead.get(address, 0.0) > time.monotonic():
                raise WeightsUnavailable(f"weights stream {address}: not answering (skipped for {DEAD_FOR_S:.0f} s)")
        good = [0]
        try:
            self._receive(address, manifest, shard, offset, out, step, good, landed)
        except BaseException:
            with self._lock:
                self.fallbacks += 1
                self.streamed_bytes += good[0]
            raise
        with self._lock:
            self.streamed_bytes += len(out)

    def _receive(self, address: str, manifest: ShardManifest, shard: ShardRecord, offset: int,
                 out: memoryview, step: int, good: list[int], landed: Callable[[memoryview], None] | None = None) -> None:
        request = json.dumps({"token": self.token, "version": manifest.version, "process": shard.process,
                              "key": shard.key, "offset": offset, "size": len(out)}).encode()
        conn, reused = self._connect(address)
        try:
            try:
                conn.sendall(_LENGTH.pack(len(request)) + request)
                header = _recv_exact(conn, _REPLY.size)
            except OSError:
                if not reused:
                    raise
                conn.close()  # the server closed it while it sat idle in our pool: once more, afresh
                conn, reused = self._connect(address, fresh=True)
                conn.sendall(_LENGTH.pack(len(request)) + request)
                header = _recv_exact(conn, _REPLY.size)
            status, length = _REPLY.unpack(header)
            if status != OK:
                reason = _recv_exact(conn, min(length, MAX_REQUEST)).decode(errors="replace")
                if status == REFUSED:
                    raise StreamRefused(f"the weights stream server {address} refused our token: {reason}")
                raise (ShardsMissing if status == NOT_FOUND else WeightsUnavailable)(f"weights stream {address}: {reason}")
            if length != len(out):
                raise ShardsCorrupt(f"{shard.key}: {address} offers {length} of {len(out)} bytes")
            got, first = 0, offset // step
            while got < len(out):
                n = conn.recv_into(out[got:])
                if n == 0:
                    raise ConnectionError(f"{address} closed after {got} of {len(out)} bytes")
                got += n
                done = got if got == len(out) else got - got % step
                for at in range(good[0], done, step):  # block by block: what passed stays ours
                    _verify(shard, out, first, step, at, min(at + step, done))
                    good[0] = min(at + step, done)
                    if landed is not None:
                        landed(out[at : good[0]])
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._idle.setdefault(address, []).append(conn)

    def _connect(self, address: str, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A connection to ``address`` and whether it was reused from the pool."""
        with self._lock:
            idle = self._idle.get(address)
            if idle and not fresh:
                return idle.pop(), True
        try:
            target = endpoints.parse(address, where="weight stream address")
            conn = endpoints.connect(target, timeout=min(CONNECT_TIMEOUT_S, self.timeout_s))
        except (OSError, endpoints.AddressError):
            with self._lock:
                self._dead[address] = time.monotonic() + DEAD_FOR_S
            raise
        conn.settimeout(self.timeout_s)
        _no_delay(conn)
        return conn, False

    def close(self) -> None:
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()


def _verify(shard: ShardRecord, out: memoryview, first: int, step: int, start: int, stop: int) -> None:
    """Check the blocks of ``out[start:stop]`` (whole blocks; block 0 of ``out`` is ``first``)."""
    for at in range(start, stop, step):
        block = first + at // step
        if block >= len(shard.checksums) or crc32(out[at : min(at + step, stop)]) != shard.checksums[block]:
            raise ShardsCorrupt(f"{shard.key}: block {block} does not match its published crc32")


def staged_lookup(arrays: Callable[[int, str], np.ndarray | None]) -> Lookup:
    """Serve the arrays a learner process staged (``_ShardServicer.array``), from their memory."""
    def lookup(version: int, process: int, key: str) -> Served | None:
        array = arrays(version, key)
        return None if array is None else as_bytes(array)

    return lookup


def stream_address(address: str, port: int = 0) -> str:
    """Where a learner process's stream server binds beside its gRPC server at ``address``: the
    same host, ``port`` (0: a free one; the manifest advertises it either way); beside a unix
    socket ``NAME.sock``, the socket ``NAME.stream.sock`` (``port`` does not apply)."""
    if address.startswith(endpoints.UNIX_SCHEME):
        path = endpoints.parse(address, where="weights address").path
        assert path is not None
        return f"{endpoints.UNIX_SCHEME}//{path.removesuffix('.sock')}.stream.sock"
    return f"{address.rsplit(':', 1)[0]}:{port}"


def _no_delay(conn: socket.socket) -> None:
    """Send small frames at once (a TCP connection; a unix socket never delays)."""
    if conn.family != socket.AF_UNIX:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

