"""The shared-directory transport of sharded weights: a version's shard files under its folder,
committed by its manifest (RWX volume, or GCS through the Cloud Storage FUSE CSI driver)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from stoker.weights.shard_format import (
    FORMAT, MANIFEST_PREFIX, ShardManifest, ShardRecord, ShardsCorrupt, ShardsMissing, as_bytes, manifest_name,
)

# A shared directory's pointer to its newest committed version, of either format (the single
# blob's ``stoker.weights.blob_directory`` writes it too): subscribers look here first.
LATEST_FILE = "LATEST.json"


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
        buffer: Any = np.empty(size, np.uint8)
        out = memoryview(buffer)
        return out[: self._read(manifest, shard, offset, out)]

    def read_into(self, manifest: ShardManifest, shard: ShardRecord, offset: int, out: memoryview) -> None:
        """``read`` into the caller's buffer: all of ``out``, or ``ShardsCorrupt``."""
        got = self._read(manifest, shard, offset, out)
        if got != len(out):
            raise ShardsCorrupt(f"{shard.key}: the file of version {manifest.version} ends {len(out) - got} bytes short")

    def _read(self, manifest: ShardManifest, shard: ShardRecord, offset: int, out: memoryview) -> int:
        """Bytes read into ``out`` (fewer than asked: a short file)."""
        path = self.directory / manifest.folder / f"p{shard.process:05d}" / shard.key
        got = 0
        try:
            with open(path, "rb") as f:
                while got < len(out):
                    n = os.preadv(f.fileno(), [out[got:]], offset + got)
                    if n == 0:
                        break
                    got += n
        except FileNotFoundError as err:
            raise ShardsMissing(f"policy version {manifest.version} was pruned from {self.directory}") from err
        return got


# ------------------------------------------------------------------------------ in process
