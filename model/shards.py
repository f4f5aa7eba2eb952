"""Sharded weights: every learner process publishes only its own shards, readers fetch by slice.

A version is a *manifest* (``ShardManifest``): per tensor (Hugging Face names and layout, as in
the single blob) its global shape, dtype and shards, each a box of index ranges, the learner
process holding it and a crc32 per block of rows. The bytes of one shard are its C-order array.
Where they live is the transport's business: files under a shared directory
(``ShardDirectory``, below), or the learner processes' own gRPC servers
(``stoker.model.shard_service``). A version exists for readers only once its manifest is
committed, which happens after every process wrote its part; the format, the commit and why this
is not Orbax: docs/architecture.md, "Sharded weights".

``ShardedWeights`` is what a subscriber's ``fetch`` returns for such a version: a Mapping of
HF-named arrays (``weights[name]`` assembles a whole tensor, the gathered copy), and
``load_into(model)``, which ``stoker.model.hf.load_hf`` calls, reading only the boxes the model's
own devices hold, from several shards in parallel, and assembling each parameter in the model's
own sharding. Every byte is checked against its block's crc32 before it is used.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stoker.model.weight_errors import WeightsCorrupt, WeightsNotFound

log = logging.getLogger(__name__)

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
    streams: tuple[str, ...] = ()  # each process's plain-TCP shard stream (stoker.model.shard_stream)

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


def rows_of(shape: Sequence[int]) -> int:
    return int(shape[0]) if shape else 1


def as_bytes(array: np.ndarray) -> memoryview:
    """The C-order bytes of ``array`` without a copy when it is contiguous (bfloat16 too, which
    the buffer protocol does not know)."""
    flat: Any = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return memoryview(flat)


def checksums(array: np.ndarray, rows_per_block: int) -> tuple[int, ...]:
    """crc32 of each block of ``rows_per_block`` rows of a C-contiguous array."""
    flat = as_bytes(array)
    row_bytes = len(flat) // max(rows_of(array.shape), 1)
    step = rows_per_block * row_bytes
    return tuple(zlib.crc32(flat[at : at + step]) for at in range(0, max(len(flat), 1), max(step, 1)))


def intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return box if all(start < stop for start, stop in box) or not box else None


# ------------------------------------------------------------------------------- reading


class ShardSource(Protocol):
    """Where a version's shard bytes come from: ``read`` returns ``size`` bytes of one shard's
    C-order array from byte ``offset`` on (a source whose ``verifies_blocks`` is true has checked
    every block against its crc32 already)."""

    def read(self, manifest: ShardManifest, shard: ShardRecord, offset: int, size: int) -> bytes | memoryview: ...


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
        with futures.ThreadPoolExecutor(max_workers=max(1, self.threads), thread_name_prefix="shard-read") as pool:
            read = list(pool.map(lambda run: self._read_blocks(*run), runs))
        blocks: dict[tuple[str, int], tuple[np.ndarray, int]] = {}  # (key, block): (its run's rows, first row)
        for (name, key, first, last), rows in zip(runs, read, strict=True):
            step = self._shard(name, key).block_rows
            for n in range(last - first + 1):
                blocks[(key, first + n)] = (rows, n * step)
        return [self._assemble(self.manifest.tensors[name], box, blocks) for name, box in wanted]

    def _run_blocks(self, name: str, key: str) -> int:
        """Blocks per read: a large shard is read as several streams in parallel."""
        tensor, shard = self.manifest.tensors[name], self._shard(name, key)
        row = (math.prod(shard.shape[1:]) if len(shard.shape) > 1 else 1) * np.dtype(dtype_of(tensor.dtype)).itemsize
        return max(1, RUN_BYTES // max(1, shard.block_rows * row))

    def _shard(self, name: str, key: str) -> ShardRecord:
        return next(s for s in self.manifest.tensors[name].shards if s.key == key)

    def _read_blocks(self, name: str, key: str, first: int, last: int) -> np.ndarray:
        """Blocks ``first..last`` of one shard, each checked against its crc32, as one array of
        rows (a view of the bytes the source gave: no copy)."""
        tensor, shard = self.manifest.tensors[name], self._shard(name, key)
        dtype = np.dtype(dtype_of(tensor.dtype))
        shape, rows = shard.shape, rows_of(shard.shape)
        row_bytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * dtype.itemsize
        start, stop = first * shard.block_rows, min((last + 1) * shard.block_rows, rows)
        data = self.source.read(self.manifest, shard, start * row_bytes, (stop - start) * row_bytes)
        if len(data) != (stop - start) * row_bytes:
            raise ShardsCorrupt(f"{name} {key}: got {len(data)} bytes for rows {start}..{stop}")
        self.stats.add(len(data))
        view, step = memoryview(data), shard.block_rows * row_bytes
        if not getattr(self.source, "verifies_blocks", False):
            for n, block in enumerate(range(first, last + 1)):
                if block >= len(shard.checksums) or zlib.crc32(view[n * step : (n + 1) * step]) != shard.checksums[block]:
                    raise ShardsCorrupt(f"{name} {key}: block {block} does not match its published crc32")
        return np.frombuffer(view, dtype).reshape((-1, *shape[1:]) if shape else ())

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
        from stoker.model.hf import CheckpointError

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


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter of a model lives: its HF name, its shape and sharding, and the HF
    boxes this process's devices hold (``devices[i]`` holds ``reads[i]``; ``None``: unplaced)."""

    name: str
    transpose: bool
    shape: tuple[int, ...]
    sharding: Any
    devices: tuple[Any, ...]
    reads: tuple[tuple[str, Box], ...]
    tied: bool = False


def _where(current: Any) -> Any:
    import jax

    sharding = getattr(current, "sharding", None)
    if isinstance(current, jax.Array) and not current.committed:
        return None
    return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def layout_of(model: Any) -> tuple[ParamSlot, ...]:
    """Every parameter's ``ParamSlot`` in ``model`` as it is placed now."""
    from stoker.model.hf import _param_items, hf_name

    tied = getattr(model, "lm_head", "absent") is None
    slots = []
    for path, var in _param_items(model):
        name, transpose = hf_name(path)
        current = var.get_value()
        shape, sharding = tuple(current.shape), _where(current)
        if sharding is not None:
            placed = sharding.addressable_devices_indices_map(shape)
            devices = tuple(placed)
            boxes = [_box(index, shape) for index in placed.values() if index is not None]
        else:
            devices, boxes = (None,), [tuple((0, n) for n in shape)]
        reads = tuple((name, tuple(reversed(b)) if transpose else b) for b in boxes)
        slots.append(ParamSlot(name, transpose, shape, sharding, devices, reads, tied))
    return tuple(slots)


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
        import jax
        import jax.numpy as jnp

        from stoker.model.hf import _param_items

        now = layout_of(model)
        if [(s.name, s.shape, s.sharding, s.devices) for s in now] != [(s.name, s.shape, s.sharding, s.devices) for s in self.layout]:
            log.warning("the model's layout changed since version %d was staged; reading its slices again", self.version)
            self.weights.load_into(model)
            return
        for (_, var), slot, parts in zip(_param_items(model), self.layout, self.pieces, strict=True):
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


def _box(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


# ----------------------------------------------------------------------------- directory

MANIFEST_PREFIX = "shards-"


def manifest_name(version: int) -> str:
    return f"{MANIFEST_PREFIX}{version:012d}.json"


def folder_name(version: int, run: str) -> str:
    return f"{MANIFEST_PREFIX}{version:012d}-{run}"


def _write(path: Path, data: bytes | memoryview, *, atomic: bool, sync: bool = True) -> None:
    target = path.with_name(f".{path.name}.tmp") if atomic else path
    with open(target, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


def fsync_file(path: Path) -> None:
    """Flush a file written with ``sync=False`` to stable storage (before its version commits)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardDirectory:
    """A shared directory (RWX volume, GCS through the Cloud Storage FUSE CSI driver) of sharded
    versions. A process writes its shards into the version's folder (``write_shard``); the
    primary then commits the manifest under its final name, the only step that makes the version
    visible, and moves ``LATEST.json`` (``commit``)."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory)
        self.keep = keep

    def write_shard(self, folder: str, process: int, key: str, array: np.ndarray, *, sync: bool = True) -> Path:
        """Write one shard's file; ``sync=False`` leaves the fsync to the caller (``fsync_file``),
        which must happen before the version commits."""
        where = self.directory / folder / f"p{process:05d}"
        where.mkdir(parents=True, exist_ok=True)
        # Not atomic: nothing under an uncommitted folder is read, and a committed one is complete.
        _write(where / key, as_bytes(array), atomic=False, sync=sync)
        return where / key

    def commit(self, manifest: ShardManifest, latest_file: str) -> None:
        data = manifest.to_json()
        _write(self.directory / manifest_name(manifest.version), data, atomic=True)
        import hashlib

        pointer = json.dumps({
            "policy_version": manifest.version, "sha256": hashlib.sha256(data).hexdigest(),
            "size_bytes": manifest.nbytes, "file": manifest_name(manifest.version), "format": FORMAT,
        }).encode()
        _write(self.directory / latest_file, pointer, atomic=True)
        self.prune(manifest.version)

    def prune(self, newest: int) -> None:
        """Keep the newest ``keep`` committed versions up to ``newest``; drop the rest, and every
        uncommitted folder at or below ``newest`` (a publish a dead process never finished).
        Folders above ``newest`` may be another process's next version in progress."""
        committed = sorted(int(p.name[len(MANIFEST_PREFIX) : -len(".json")]) for p in self.directory.glob(f"{MANIFEST_PREFIX}*.json"))
        retained = [v for v in committed if v <= newest][-self.keep :]
        folders = set()
        for version in committed:
            if version in retained:
                folders.add(json.loads((self.directory / manifest_name(version)).read_bytes())["folder"])
            else:  # manifest first: a reader that finds no manifest never opens the folder
                (self.directory / manifest_name(version)).unlink(missing_ok=True)
        for folder in self.directory.glob(f"{MANIFEST_PREFIX}*-*"):
            version = int(folder.name[len(MANIFEST_PREFIX) :].split("-", 1)[0])
            if folder.is_dir() and folder.name not in folders and version <= newest:
                shutil.rmtree(folder, ignore_errors=True)

    def manifest(self, version: int) -> ShardManifest | None:
        try:
            return ShardManifest.from_json((self.directory / manifest_name(version)).read_bytes())
        except FileNotFoundError:
            return None

    def read(self, manifest: ShardManifest, shard: ShardRecord, offset: int, size: int) -> memoryview:
        """Into one fresh buffer (writable, so a box inside one read is assembled without a copy)."""
        path = self.directory / manifest.folder / f"p{shard.process:05d}" / shard.key
        buffer: Any = np.empty(size, np.uint8)
        out, got = memoryview(buffer), 0
        try:
            with open(path, "rb") as f:
                while got < size:
                    n = os.preadv(f.fileno(), [out[got:]], offset + got)
                    if n == 0:
                        break  # a short file: the caller's size check says so
                    got += n
        except FileNotFoundError as err:
            raise ShardsMissing(f"policy version {manifest.version} was pruned from {self.directory}") from err
        return out[:got]


# ------------------------------------------------------------------------------ in process


class DeviceWeights(Mapping[str, np.ndarray]):
    """Weights handed over inside one process (colocated mode): ``load_into`` reshards each
    parameter from ``source``'s arrays (another module of the same architecture, e.g. the
    learner's policy over a ``policy_copy``) into the target's sharding device to device, never
    through the host. As a Mapping it gives host copies (HF names and layout)."""

    def __init__(self, source: Any):
        from stoker.model.hf import _param_items, hf_name

        self._values: dict[str, tuple[Any, bool]] = {}
        for path, var in _param_items(source):
            name, transpose = hf_name(path)
            self._values[name] = (var.get_value(), transpose)

    def __getitem__(self, name: str) -> np.ndarray:
        value, transpose = self._values[name]
        host = np.asarray(value)
        return np.ascontiguousarray(host.T) if transpose else host

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def load_into(self, model: Any) -> None:
        import jax

        from stoker.model.hf import CheckpointError, _param_items, hf_name

        items = _param_items(model)
        missing = sorted({hf_name(path)[0] for path, _ in items} - set(self._values))
        if missing:
            raise CheckpointError(f"the weights do not match the model: missing {missing[:5]}")
        for path, var in items:
            value, _ = self._values[hf_name(path)[0]]
            current = var.get_value()
            if tuple(value.shape) != tuple(current.shape):
                raise CheckpointError(f"{hf_name(path)[0]}: shape {tuple(value.shape)} does not fit the model")
            where = getattr(current, "sharding", None)
            if isinstance(current, jax.Array) and not current.committed:
                where = None
            cast = value.astype(current.dtype)
            var.set_value(jax.device_put(cast, where) if isinstance(where, jax.sharding.Sharding) else cast)
