"""Reading a sharded version by slice.

``ShardedWeights`` is what a subscriber's ``fetch`` returns for a sharded version: a Mapping of
HF-named arrays (``weights[name]`` assembles a whole tensor, the gathered copy), and
``load_into(model)``, which ``stoker.model.hf.load_hf`` calls, reading only the boxes the model's
own devices hold, from several shards in parallel, and assembling each parameter in the model's
own sharding. Every byte is checked against its block's crc32 before it is used. The bytes come
from a ``ShardSource``: the learners' streams (``shard_stream``), their gRPC servers
(``shard_service``), a shared directory (``shard_directory``) or a relay (``relay_source``).
``StagedWeights``: a version's boxes for one layout, read ahead into host memory.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from stoker.hfconfig import CheckpointError
from stoker.weights.shard_format import (
    READ_THREADS, RUN_BYTES, Box, ShardManifest, ShardRecord, ShardsCorrupt, TensorRecord, crc32, dtype_of, intersect, rows_of,
)
from stoker.weights.shard_layout import ParamSlot, layout_of

log = logging.getLogger(__name__)


class ShardSource(Protocol):
    """Where a version's shard bytes come from: ``read`` returns ``size`` bytes of one shard's
    C-order array from byte ``offset`` on (a source whose ``verifies_blocks`` is true has checked
    every block against its crc32 already)."""

    def read(self, manifest: ShardManifest, shard: ShardRecord, offset: int, size: int) -> bytes | memoryview: ...


class IntoShardSource(ShardSource, Protocol):
    """A source that can also receive into the caller's buffer: ``read_into`` fills all of
    ``out`` (1-D bytes) with the shard's bytes from ``offset`` on, or raises. The reader then
    puts every read of a shard in one buffer, so a tensor of several reads needs no assembly
    copy."""

    def read_into(self, manifest: ShardManifest, shard: ShardRecord, offset: int, out: memoryview) -> None: ...


@dataclass
class ReadStats:
    bytes_read: int = 0
    reads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes_read += n
            self.reads += 1


class ShardedWeights(Mapping[str, np.ndarray]):
    """One committed version, read lazily from ``source`` (see the module doc)."""

    def __init__(self, manifest: ShardManifest, source: ShardSource, *, threads: int = READ_THREADS):
        self.manifest = manifest
        self.source = source
        self.threads = threads
        self.stats = ReadStats()

    @property
    def version(self) -> int:
        return self.manifest.version

    def __getitem__(self, name: str) -> np.ndarray:
        tensor = self.manifest.tensors[name]
        return self.read_box(tensor, tuple((0, n) for n in tensor.shape))

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest.tensors)

    def __len__(self) -> int:
        return len(self.manifest.tensors)

    def read_box(self, tensor: TensorRecord, box: Box) -> np.ndarray:
        """The part ``box`` of ``tensor``, assembled from every shard it overlaps."""
        return self.read_boxes([(tensor.name, box)])[0]

    def read_boxes(self, wanted: Sequence[tuple[str, Box]]) -> list[np.ndarray]:
        """Several (tensor, box) parts at once. The checksum blocks they need are gathered first,
        each read once however many boxes overlap it (adjacent blocks of a shard in one read),
        over ``threads`` in parallel; then each box is cut from them."""
        needs: dict[tuple[str, str], set[int]] = {}
        for name, box in wanted:
            tensor = self.manifest.tensors[name]
            for shard in tensor.shards:
                part = intersect(shard.box, box)
                if part is not None:
                    first, last = _block_span(shard, part)
                    needs.setdefault((name, shard.key), set()).update(range(first, last + 1))
        expect = getattr(self.source, "expect", None)
        if expect is not None:  # a relaying source: servers below it may wait for these blocks
            expect(self.manifest, [(key, b) for (_, key), blocks in needs.items() for b in blocks])
        runs = [
            (name, key, a, b) for (name, key), blocks in needs.items()
            for a, b in _runs(sorted(blocks), self._run_blocks(name, key))
        ]
        landing = self._landing(needs) if hasattr(self.source, "read_into") else {}
        with futures.ThreadPoolExecutor(max_workers=max(1, self.threads), thread_name_prefix="shard-read") as pool:
            read = list(pool.map(lambda r: self._read_blocks(r[0], r[1], r[2], r[3], landing.get((r[0], r[1]))), runs))
        blocks: dict[tuple[str, int], tuple[np.ndarray, int]] = {}  # (key, block): (the rows it lies in, its first row there)
        for (name, key, first, last), (rows, rows_from) in zip(runs, read, strict=True):
            step = self._shard(name, key).block_rows
            for n in range(first, last + 1):
                blocks[(key, n)] = (rows, (n - rows_from) * step)
        return [self._assemble(self.manifest.tensors[name], box, blocks) for name, box in wanted]

    def _landing(self, needs: dict[tuple[str, str], set[int]]) -> dict[tuple[str, str], tuple[np.ndarray, int]]:
        """Per shard whose needed blocks are one stretch: one buffer for all its reads, as rows, and
        the block it starts at. Unset (not zeroed): every byte is received before use."""
        out = {}
        for (name, key), needed in needs.items():
            shard, first, last = self._shard(name, key), min(needed), max(needed)
            if not shard.shape or last - first + 1 != len(needed):
                continue
            dtype = np.dtype(dtype_of(self.manifest.tensors[name].dtype))
            rows = min((last + 1) * shard.block_rows, rows_of(shard.shape)) - first * shard.block_rows
            out[(name, key)] = (np.empty((rows, *shard.shape[1:]), dtype), first)
        return out

    def _run_blocks(self, name: str, key: str) -> int:
        """Blocks per read: a large shard is read as several streams in parallel."""
        tensor, shard = self.manifest.tensors[name], self._shard(name, key)
        row = (math.prod(shard.shape[1:]) if len(shard.shape) > 1 else 1) * np.dtype(dtype_of(tensor.dtype)).itemsize
        return max(1, RUN_BYTES // max(1, shard.block_rows * row))

    def _shard(self, name: str, key: str) -> ShardRecord:
        return next(s for s in self.manifest.tensors[name].shards if s.key == key)

    def _read_blocks(self, name: str, key: str, first: int, last: int,
                     landing: tuple[np.ndarray, int] | None = None) -> tuple[np.ndarray, int]:
        """Blocks ``first..last`` of one shard, each checked against its crc32: (the rows they
        landed in, the block those rows start at). Received into ``landing`` (the shard's buffer
        from ``_landing``, shared by its reads) or, without one, a view of the bytes the source
        gave; no copy either way."""
        tensor, shard = self.manifest.tensors[name], self._shard(name, key)
        dtype = np.dtype(dtype_of(tensor.dtype))
        shape, rows = shard.shape, rows_of(shard.shape)
        row_bytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * dtype.itemsize
        start, stop = first * shard.block_rows, min((last + 1) * shard.block_rows, rows)
        if landing is not None:
            into, from_block = landing
            at = (first - from_block) * shard.block_rows
            target: Any = into[at : at + stop - start].reshape(-1).view(np.uint8)
            data: bytes | memoryview = memoryview(target)
            self.source.read_into(self.manifest, shard, start * row_bytes, data)  # type: ignore[attr-defined]
        else:
            data = self.source.read(self.manifest, shard, start * row_bytes, (stop - start) * row_bytes)
        if len(data) != (stop - start) * row_bytes:
            raise ShardsCorrupt(f"{name} {key}: got {len(data)} bytes for rows {start}..{stop}")
        self.stats.add(len(data))
        view, step = memoryview(data), shard.block_rows * row_bytes
        if not getattr(self.source, "verifies_blocks", False):
            for n, block in enumerate(range(first, last + 1)):
                if block >= len(shard.checksums) or crc32(view[n * step : (n + 1) * step]) != shard.checksums[block]:
                    raise ShardsCorrupt(f"{name} {key}: block {block} does not match its published crc32")
        if landing is not None:
            return landing
        return np.frombuffer(view, dtype).reshape((-1, *shape[1:]) if shape else ()), first

    @staticmethod
    def _assemble(tensor: TensorRecord, box: Box, blocks: dict[tuple[str, int], tuple[np.ndarray, int]]) -> np.ndarray:
        """``box`` of ``tensor`` from its shards' blocks. A box inside one run of one shard, read
        into writable memory, is returned as a view of it (no copy); otherwise copied together."""
        pieces: list[tuple[tuple[slice, ...], np.ndarray, Box | None]] = []  # (where in out, values, the part, once per shard)
        for shard in tensor.shards:
            part = intersect(shard.box, box)
            if part is None:
                continue
            if not shard.shape:
                pieces.append(((), blocks[(shard.key, 0)][0], ()))
                continue
            first, last = _block_span(shard, part)
            p0, p1 = part[0][0] - shard.box[0][0], part[0][1] - shard.box[0][0]  # the shard's own rows
            trailing = tuple(slice(x - o, y - o) for (x, y), (o, _) in zip(part[1:], shard.box[1:], strict=True))
            placed = tuple(slice(x - o, y - o) for (x, y), (o, _) in zip(part[1:], box[1:], strict=True))
            for run, at, b0, b1 in _groups(blocks, shard.key, first, last):  # blocks b0..b1 lie in one run
                g0, g1 = max(p0, b0 * shard.block_rows), min(p1, (b1 + 1) * shard.block_rows)
                rows = run[at + g0 - b0 * shard.block_rows : at + g1 - b0 * shard.block_rows]
                to = g0 + shard.box[0][0] - box[0][0]
                pieces.append(((slice(to, to + g1 - g0), *placed), rows[(slice(None), *trailing)], None))
            pieces[-1] = (pieces[-1][0], pieces[-1][1], part)  # counted once per shard
        shape = tuple(b - a for a, b in box)
        covered = sum(math.prod(b - a for a, b in part) for _, _, part in pieces if part is not None)
        if covered != math.prod(shape):
            raise ShardsCorrupt(f"{tensor.name}: the shards cover {covered} of the {math.prod(shape)} elements asked for")
        if len(pieces) == 1 and pieces[0][1].flags.c_contiguous and pieces[0][1].flags.writeable and pieces[0][1].size == math.prod(shape):
            return pieces[0][1].reshape(shape)
        out = np.empty(shape, dtype_of(tensor.dtype))
        for where, piece, _ in pieces:
            out[where] = piece
        return out

    def load_into(self, model: Any) -> None:
        """Overwrite ``model``'s parameters, each in its current sharding, reading only the boxes
        this process's devices hold. Everything is read and verified before any parameter
        changes, so a failed read (a pruned version, a bad block) leaves the model as it was."""
        self.stage(layout_of(model)).load_into(model)

    def stage(self, layout: Sequence[ParamSlot]) -> StagedWeights:
        """Read and verify (into host memory) every box ``layout``'s devices hold; placing them
        on the devices is ``StagedWeights.load_into``, which reads nothing more."""
        names = {slot.name for slot in layout}
        tied = any(slot.tied for slot in layout)
        extra = sorted(set(self.manifest.tensors) - names - ({"lm_head.weight"} if tied else set()))
        missing = sorted(names - set(self.manifest.tensors))
        if missing or extra:
            raise CheckpointError(f"published weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
        for slot in layout:
            hf_shape = tuple(reversed(slot.shape)) if slot.transpose else slot.shape
            if hf_shape != self.manifest.tensors[slot.name].shape:
                raise CheckpointError(f"{slot.name}: published shape {self.manifest.tensors[slot.name].shape} does not fit the model")
        host = iter(self.read_boxes([read for slot in layout for read in slot.reads]))
        return StagedWeights(self, tuple(layout), tuple(tuple(next(host) for _ in slot.reads) for slot in layout))



class StagedWeights(Mapping[str, np.ndarray]):
    """A version's boxes for one model layout, read and verified, in host memory (a rollout
    follower's prefetch). ``load_into`` only places them; a model laid out otherwise than
    ``layout`` is loaded by slice from the source instead."""

    def __init__(self, weights: ShardedWeights, layout: tuple[ParamSlot, ...], pieces: tuple[tuple[np.ndarray, ...], ...]):
        self.weights, self.layout, self.pieces = weights, layout, pieces

    @property
    def version(self) -> int:
        return self.weights.version

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for parts in self.pieces for p in parts)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)

    def load_into(self, model: Any) -> None:
        # On use: this module loads with numpy alone, as stoker.weights.shard_layout's doc says why.
        import jax
        import jax.numpy as jnp

        from stoker.model.hf import param_items

        now = layout_of(model)
        if [(s.name, s.shape, s.sharding, s.devices) for s in now] != [(s.name, s.shape, s.sharding, s.devices) for s in self.layout]:
            log.warning("the model's layout changed since version %d was staged; reading its slices again", self.version)
            self.weights.load_into(model)
            return
        for (_, var), slot, parts in zip(param_items(model), self.layout, self.pieces, strict=True):
            current = var.get_value()
            arrays = [np.asarray(p.T if slot.transpose else p).astype(current.dtype, copy=False) for p in parts]
            if slot.sharding is None:
                var.set_value(jnp.asarray(arrays[0], dtype=current.dtype))
            else:
                shards = [jax.device_put(a, d) for a, d in zip(arrays, slot.devices, strict=True)]
                var.set_value(jax.make_array_from_single_device_arrays(slot.shape, slot.sharding, shards))


def _groups(blocks: dict[tuple[str, int], tuple[np.ndarray, int]], key: str, first: int,
            last: int) -> Iterator[tuple[np.ndarray, int, int, int]]:
    """Blocks ``first..last`` of shard ``key`` as maximal stretches read in one run: (the run's
    rows, the first block's row in it, first block, last block)."""
    start = first
    for b in range(first + 1, last + 2):
        if b > last or blocks[(key, b)][0] is not blocks[(key, start)][0]:
            run, at = blocks[(key, start)]
            yield run, at, start, b - 1
            start = b


def _block_span(shard: ShardRecord, part: Box) -> tuple[int, int]:
    """The first and last checksum block of ``shard`` that rows of ``part`` fall in."""
    if not shard.shape:
        return 0, 0
    lo, hi = part[0][0] - shard.box[0][0], part[0][1] - shard.box[0][0]
    return lo // shard.block_rows, (hi - 1) // shard.block_rows


def _runs(blocks: list[int], longest: int) -> Iterator[tuple[int, int]]:
    """Runs of consecutive block numbers of at most ``longest`` blocks, as (first, last)."""
    start = prev = blocks[0]
    for b in blocks[1:]:
        if b != prev + 1 or b - start >= longest:
            yield start, prev
            start = b
        prev = b
    yield start, prev
