"""The sharded weights format: a version's manifest (per tensor its shape, dtype and shards, each
a box with the learner process holding it and a crc32 per block of rows) and the byte-level
helpers every transport shares. What the format is and why it is not Orbax: docs/architecture.md,
"Sharded weights"."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from isal import isal_zlib

from stoker.weights.errors import WeightsCorrupt, WeightsNotFound


FORMAT = "stoker-shards/1"
# Rows per checksum block: a reader verifies (so reads) whole blocks; this many bytes bounds the
# over-read at either end of a slice.
BLOCK_BYTES = 4 << 20
READ_THREADS = 8
RUN_BYTES = 16 << 20  # the most one read (one gRPC stream) asks for: larger shards go as parallel reads

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension


class ShardsMissing(WeightsNotFound):
    """The version was pruned (or never committed) while a reader wanted it."""


class ShardsCorrupt(WeightsCorrupt):
    """Bytes that do not match their published crc32 or size."""


@dataclass(frozen=True)
class ShardRecord:
    box: Box  # where this shard sits in the (HF-layout) tensor
    process: int  # the learner process that holds it (and serves it, peer transport)
    key: str  # its name within the version: a file name, or a peer server's key
    block_rows: int  # rows (dimension 0) per checksum block
    checksums: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)


@dataclass(frozen=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]
    dtype: str
    shards: tuple[ShardRecord, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(dtype_of(self.dtype)).itemsize


@dataclass(frozen=True)
class ShardManifest:
    version: int
    folder: str  # the version's folder (directory transport), unique per publishing run
    processes: int
    tensors: dict[str, TensorRecord]
    peers: tuple[str, ...] = ()  # each process's weights server, peer transport (by process index)
    streams: tuple[str, ...] = ()  # each process's plain-TCP shard stream (stoker.weights.shard_stream)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def to_json(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "policy_version": self.version, "folder": self.folder, "processes": self.processes,
            "peers": list(self.peers), "streams": list(self.streams),
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "shards": [
                    {"box": [list(r) for r in s.box], "process": s.process, "key": s.key,
                     "block_rows": s.block_rows, "crc32": list(s.checksums)} for s in t.shards
                ]} for t in self.tensors.values()
            ],
        }).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ShardManifest:
        try:
            raw = json.loads(data)
            if raw.get("format") != FORMAT:
                raise ShardsCorrupt(f"not a {FORMAT} manifest (format {raw.get('format')!r})")
            tensors = {
                t["name"]: TensorRecord(t["name"], tuple(t["shape"]), str(t["dtype"]), tuple(
                    ShardRecord(tuple((int(a), int(b)) for a, b in s["box"]), int(s["process"]), str(s["key"]),
                                int(s["block_rows"]), tuple(int(c) for c in s["crc32"]))
                    for s in t["shards"]
                )) for t in raw["tensors"]
            }
            return cls(int(raw["policy_version"]), str(raw["folder"]), int(raw["processes"]), tensors,
                       tuple(raw.get("peers", ())), tuple(raw.get("streams", ())))
        except (KeyError, TypeError, ValueError) as err:
            raise ShardsCorrupt(f"not a weights shard manifest: {err}") from err


def dtype_of(name: str) -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def block_rows(shape: Sequence[int], itemsize: int, block_bytes: int = BLOCK_BYTES) -> int:
    row = math.prod(shape[1:]) * itemsize if len(shape) > 1 else itemsize
    return max(1, block_bytes // max(row, 1))


@dataclass(frozen=True)
class BlockGeometry:
    block_bytes: int  # bytes per checksum block (the last one may be shorter)
    total_bytes: int  # the shard's bytes

    def span(self, block: int) -> tuple[int, int]:
        start = block * self.block_bytes
        return start, min(start + self.block_bytes, self.total_bytes)


def geometry(manifest: ShardManifest, shard: ShardRecord) -> BlockGeometry:
    """How ``shard``'s bytes divide into checksum blocks (what a relay or a stream reads by)."""
    tensor = next(t for t in manifest.tensors.values() if any(s.key == shard.key for s in t.shards))
    itemsize = np.dtype(dtype_of(tensor.dtype)).itemsize
    shape = shard.shape
    row = (math.prod(shape[1:]) if len(shape) > 1 else 1) * itemsize
    total = math.prod(shape) * itemsize
    return BlockGeometry(max(shard.block_rows * row, 1) if shape else total, total)


def rows_of(shape: Sequence[int]) -> int:
    return int(shape[0]) if shape else 1


def as_bytes(array: np.ndarray) -> memoryview:
    """The C-order bytes of ``array`` without a copy when it is contiguous (bfloat16 too, which
    the buffer protocol does not know)."""
    flat: Any = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return memoryview(flat)


def crc32(data: bytes | memoryview) -> int:
    """zlib's crc32 (the same values, so published manifests stay valid), computed by ISA-L at
    ~4x zlib's speed, outside the GIL like zlib's: on the reader it was a third of the CPU per byte
    (benchmarks/README.md, "Sharded weights")."""
    return int(isal_zlib.crc32(data))


def checksums(array: np.ndarray, rows_per_block: int) -> tuple[int, ...]:
    """crc32 of each block of ``rows_per_block`` rows of a C-contiguous array."""
    flat = as_bytes(array)
    row_bytes = len(flat) // max(rows_of(array.shape), 1)
    step = rows_per_block * row_bytes
    return tuple(crc32(flat[at : at + step]) for at in range(0, max(len(flat), 1), max(step, 1)))


def intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return box if all(start < stop for start, stop in box) or not box else None


MANIFEST_PREFIX = "shards-"


def manifest_name(version: int) -> str:
    return f"{MANIFEST_PREFIX}{version:012d}.json"


def folder_name(version: int, run: str) -> str:
    return f"{MANIFEST_PREFIX}{version:012d}-{run}"

