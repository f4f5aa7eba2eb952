"""The read side of a relaying rollout server (``RelayedSource(relay, primary)``): upstream relays
first (each relay's shard stream, then its gRPC), then the primary source (the learner's servers or
the shared directory), each verified block put in the relay's cache for the servers below.

Per byte, one copy and one crc32: a read lands in one buffer (``recv_into`` from a relay's
stream, or the gRPC chunks copied in), the cache keeps views of that buffer's blocks, and the
read returns the buffer itself. A block is checked once, by whoever received it: the stream
client, the primary if it says it verifies (``verifies_blocks``), or here; so this source
``verifies_blocks`` and the reader does not check again. Measured in benchmarks/README.md, "One
relay hop".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from stoker.weights.errors import WeightsError
from stoker.weights.shard_relay import WeightRelay
from stoker.weights.shard_service import translate
from stoker.weights.shards import ShardManifest, ShardRecord, ShardSource, ShardsCorrupt, crc32, geometry

log = logging.getLogger(__name__)


class RelayedSource:
    """``ShardSource`` of a relaying server: upstream relays, then the primary source; every
    verified block goes into the relay's cache for the servers below it."""

    verifies_blocks = True  # every block it returns matched its crc32, checked once (see the module doc)

    def __init__(self, relay: WeightRelay, primary: ShardSource):
        self.relay, self.primary = relay, primary
        self.upstream = relay.upstream
        self._registered = False

    def expect(self, manifest: ShardManifest, blocks: Iterable[tuple[str, int]]) -> None:
        planned = list(blocks)
        # Planned before registering: once anyone is told to read from us, requests wait for these.
        self.relay.cache.expect(manifest, planned)
        if self.relay.registry is not None and not self._registered:
            self._registered = True  # a version's first read names its layout (a server's whole stage)
            found = self.relay.discover(manifest, planned)
            self.upstream = found + tuple(a for a in self.relay.upstream if a not in found)

    def _sources(self, manifest: ShardManifest, shard: ShardRecord) -> Iterator[tuple[str, str, Any]]:
        """(source name, how it is read, what with) in the order tried: "stream" (a relay's
        stream address: blocks land verified), "pieces" (``open(offset, size)`` gives the bytes
        in pieces, checked here) or "read" (the primary's ``read``)."""
        for address in self.upstream:
            stream = self.relay.streams_of.get(address)
            if stream:
                yield f"relay {address} stream", "stream", stream
            yield f"relay {address}", "pieces", lambda o, n, a=address: self.relay.stream(a, manifest, shard, o, n)
        stream = getattr(self.primary, "stream", None)
        if stream is not None:
            yield "primary", "pieces", lambda o, n: stream(manifest, shard, o, n)
        else:
            yield "primary", "read", None

    def read(self, manifest: ShardManifest, shard: ShardRecord, offset: int, size: int) -> memoryview:
        buffer: Any = np.empty(size, np.uint8)  # not zeroed: every byte is received before use
        return self._read(manifest, shard, offset, memoryview(buffer), ours=True)

    def read_into(self, manifest: ShardManifest, shard: ShardRecord, offset: int, out: memoryview) -> None:
        """``read`` into the caller's buffer; the cache keeps views of it."""
        self._read(manifest, shard, offset, out, ours=False)

    def _read(self, manifest: ShardManifest, shard: ShardRecord, offset: int, out: memoryview, *, ours: bool) -> memoryview:
        """Fill ``out``; returns where the bytes are: ``out``, or the primary's own buffer when
        ``out`` is ``ours`` to drop (no copy)."""
        step = geometry(manifest, shard).block_bytes
        if offset % step:
            raise ValueError(f"{shard.key}: relayed reads start at a block boundary (offset {offset})")
        first, size = offset // step, len(out)
        got = 0  # bytes verified, cached and counted so far (whole blocks)
        name = ""

        def keep(stop: int, view: memoryview) -> None:
            nonlocal got
            self.relay.cache.put(manifest, shard.key, first + got // step, view)
            self.relay.take(name, stop - got)
            got = stop

        def landed(view: memoryview) -> None:  # a verified block, a view of ``out``, from a relay's stream
            keep(got + len(view), view)

        def settle(received: int, check: bool) -> None:
            """The blocks complete in ``out[got:received]``: checked (unless already), cached."""
            while got < size and received >= min(got + step, size):
                stop, block = min(got + step, size), first + got // step
                view = out[got:stop]
                if check and (block >= len(shard.checksums) or crc32(view) != shard.checksums[block]):
                    raise ShardsCorrupt(f"{shard.key}: block {block} from {name} does not match its crc32")
                keep(stop, view)

        failure: Exception | None = None
        for name, kind, what in self._sources(manifest, shard):
            if got == size:
                break
            try:
                if kind == "stream":
                    self.relay.receive(what, manifest, shard, offset + got, out[got:], landed)
                elif kind == "pieces":
                    received = got
                    for piece in what(offset + got, size - got):
                        if len(piece) > size - received:
                            raise ShardsCorrupt(f"{shard.key}: {name} sent more than the {size} bytes asked for")
                        out[received : received + len(piece)] = piece
                        received += len(piece)
                        settle(received, check=True)
                else:
                    into = getattr(self.primary, "read_into", None)
                    if into is not None:
                        into(manifest, shard, offset + got, out[got:])
                    else:
                        rest = memoryview(self.primary.read(manifest, shard, offset + got, size - got)).cast("B")
                        if len(rest) != size - got:
                            raise ShardsCorrupt(f"{shard.key}: {name} gave {len(rest)} of {size - got} bytes")
                        if got == 0 and ours:
                            out = rest  # the primary's own buffer: no copy
                        else:
                            out[got:] = rest
                    settle(size, check=not getattr(self.primary, "verifies_blocks", False))
                if got < size:
                    raise ShardsCorrupt(f"{shard.key}: {name} ended after {got} of {size} bytes")
            except (grpc.RpcError, WeightsError, OSError) as err:
                failure = err
                if name != "primary":
                    self.relay.fell_back()
                    log.info("weights relay: %s failed on %s at block %d (%s); reading on from the next source",
                             name, shard.key, first + got // step, getattr(err, "details", lambda: err)())
        if got < size:
            last = (offset + size - 1) // step
            self.relay.cache.give_up(manifest.version, shard.key, range(first + got // step, last + 1))
            if isinstance(failure, WeightsError):
                raise failure
            raise translate(failure) if isinstance(failure, grpc.RpcError) else ShardsCorrupt(str(failure))
        return out
