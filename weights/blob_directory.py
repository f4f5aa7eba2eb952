"""The single blob in a shared directory (a PersistentVolume, or a local path): each version is
written to a temporary name, fsynced and renamed, then its manifest and the ``LATEST.json``
pointer are renamed in the same way, so a reader never sees a half-written version under a final
name. Only the newest ``keep`` versions are retained."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from stoker.weights.blob_format import Blob, WeightsInfo
from stoker.weights.errors import WeightsCorrupt
from stoker.weights.shards import FORMAT as SHARDS_FORMAT
from stoker.weights.shards import LATEST_FILE


def blob_file_name(version: int) -> str:
    return f"weights-{version:012d}.safetensors"


def blob_manifest_name(version: int) -> str:
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
         "file": blob_file_name(info.version)}
    ).encode()


def read_info(path: Path) -> WeightsInfo | None:
    """The version a manifest (or the ``LATEST.json`` pointer, of either format) describes; None
    if there is no such file."""
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


class BlobDirectory:
    """The publisher's side: ``write`` a version, then prune all but the newest ``keep``."""

    def __init__(self, directory: Path, keep: int):
        self.directory = directory
        self.keep = keep
        directory.mkdir(parents=True, exist_ok=True)

    def write(self, blob: Blob) -> None:
        version = blob.info.version
        _atomic_write(self.directory / blob_file_name(version), blob.data)
        manifest = _info_json(blob.info)
        _atomic_write(self.directory / blob_manifest_name(version), manifest)
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
                (self.directory / blob_manifest_name(version)).unlink(missing_ok=True)
                (self.directory / blob_file_name(version)).unlink(missing_ok=True)
