"""``gs://`` checkpoints: fetched once into a local cache before a process reads them.

The learner, the rollout servers, the actors (tokenizer files only) and ``stoker run`` call
``fetch`` at start, through ``stoker.manifest.load_job(fetch=...)``, so every later reader sees a
local directory. Credentials are Application Default Credentials: on GKE, the metadata server's
token for the pod's Workload Identity (no key files). ``STORAGE_EMULATOR_HOST`` points the client
at a local fake GCS server (tests).

Each object is downloaded in ranged chunks into ``NAME.partial`` (resumed after a restart while
the object's generation is unchanged), checked against the object's CRC32C (MD5 when it has no
CRC32C), then renamed; ``.stoker-fetched.json`` records what each local file was verified
against, so a later start skips objects whose generation and checksum are unchanged. A lock file
serialises processes sharing one cache (``stoker run`` starts several). No JAX here: the actor
image reads this too.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_ENV = "STOKER_CHECKPOINT_CACHE"
DEFAULT_CACHE = Path("~/.cache/stoker/checkpoints")
MARKER = ".stoker-fetched.json"
INDEX_FILE = "model.safetensors.index.json"
# Weight formats Stoker never reads (a repository often carries them beside its safetensors).
UNREAD_SUFFIXES = (".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt", ".onnx")
CHUNK_BYTES = 64 << 20
PROGRESS_SECONDS = 10.0

_log = logging.getLogger(__name__)


class RemoteCheckpointError(Exception):
    """A checkpoint URI that cannot be fetched; the message is one line."""


def is_remote(path: str | None) -> bool:
    return bool(path) and str(path).startswith("gs://")


def split_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> ("bucket", "some/prefix")."""
    if not uri.startswith("gs://"):
        raise RemoteCheckpointError(f"{uri}: expected a gs://bucket/path URI")
    bucket, _, prefix = uri[len("gs://"):].partition("/")
    if not bucket:
        raise RemoteCheckpointError(f"{uri}: no bucket; expected gs://bucket/path")
    return bucket, prefix.strip("/")


def cache_root() -> Path:
    """``$STOKER_CHECKPOINT_CACHE`` (the operator mounts a volume there), else ~/.cache/stoker."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def local_path(uri: str, root: Path | None = None) -> Path:
    bucket, prefix = split_uri(uri)
    return (root or cache_root()) / bucket / prefix


@dataclass
class FetchReport:
    path: Path
    downloaded: int = 0  # objects
    skipped: int = 0
    bytes: int = 0


def fetch(uri: str, *, root: Path | None = None, weights: bool = True, client: Any = None) -> FetchReport:
    """The local copy of ``uri`` (a checkpoint directory, or one object such as a tokenizer.json);
    ``weights=False`` leaves the safetensors out (the actors read only config and tokenizer).
    Only the directory's own files come, and never weight formats Stoker does not read (.bin, .pth...)."""
    bucket_name, prefix = split_uri(uri)
    dest = local_path(uri, root)
    client = client or _client()
    bucket = client.bucket(bucket_name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.parent / f".{dest.name or bucket_name}.lock"):
        blobs = _listing(client, uri, bucket_name, prefix)
        report = FetchReport(dest)
        if len(blobs) == 1 and blobs[0].name == prefix:  # one object, not a directory
            _fetch_object(uri, bucket, blobs[0], dest, _Record(dest.parent / MARKER), dest.name, report)
            return report
        wanted = {b.name[len(prefix) + 1 if prefix else 0:]: b for b in blobs if not b.name.endswith("/")}
        skipped = UNREAD_SUFFIXES if weights else (*UNREAD_SUFFIXES, ".safetensors")
        wanted = {name: b for name, b in wanted.items() if not name.endswith(skipped)}
        record = _Record(dest / MARKER)
        if weights and INDEX_FILE in wanted:  # every shard the index names must exist before anything big moves
            _fetch_object(uri, bucket, wanted[INDEX_FILE], dest / INDEX_FILE, record, INDEX_FILE, report)
            missing = sorted(set(_index_shards(dest / INDEX_FILE, uri)) - set(wanted))
            if missing:
                raise RemoteCheckpointError(
                    f"{uri.rstrip('/')}/{missing[0]}: not found ({INDEX_FILE} names it"
                    + (f", and {len(missing) - 1} more shards" if len(missing) > 1 else "") + ")"
                )
        for name in sorted(wanted):
            if name != INDEX_FILE or not weights:
                _fetch_object(uri, bucket, wanted[name], dest / name, record, name, report)
        _log.info("%s: %d objects in %s (%d downloaded, %s; %d already complete)",
                  uri, len(wanted), dest, report.downloaded, _size(report.bytes), report.skipped)
        return report


def _client() -> Any:
    try:
        from google.cloud import storage
    except ImportError:  # pragma: no cover - a runtime dependency
        raise RemoteCheckpointError("gs:// checkpoints need the google-cloud-storage package") from None
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project="stoker-emulator", credentials=AnonymousCredentials())
    from google.auth.exceptions import DefaultCredentialsError

    try:
        return storage.Client()  # Application Default Credentials: Workload Identity on GKE
    except DefaultCredentialsError:
        raise RemoteCheckpointError(
            "no Google credentials for gs://: on GKE run the pod as a Kubernetes service account bound by "
            "Workload Identity (docs/gke.md); elsewhere `gcloud auth application-default login`"
        ) from None


def _explain(uri: str, bucket: str, exc: Exception) -> RemoteCheckpointError:
    from google.api_core import exceptions as api

    if isinstance(exc, (api.Forbidden, api.Unauthorized)):
        return RemoteCheckpointError(
            f"{uri}: access denied ({exc.code}); the pod's Kubernetes service account needs Workload Identity "
            f"bound to a Google service account with roles/storage.objectViewer on gs://{bucket}"
        )
    if isinstance(exc, api.NotFound):
        return RemoteCheckpointError(f"{uri}: bucket gs://{bucket} does not exist")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return RemoteCheckpointError(f"{uri}: {first}")


def _listing(client: Any, uri: str, bucket: str, prefix: str) -> list[Any]:
    from google.api_core.exceptions import GoogleAPICallError

    try:
        # The directory's own files only: a repository's subfolders (Llama's original/) are not read.
        under = list(client.list_blobs(bucket, prefix=f"{prefix}/" if prefix else None, delimiter="/"))
        exact = [] if under or not prefix else [b for b in client.list_blobs(bucket, prefix=prefix) if b.name == prefix]
    except GoogleAPICallError as exc:
        raise _explain(uri, bucket, exc) from None
    if not under and not exact:
        raise RemoteCheckpointError(f"{uri}: no such object or directory in gs://{bucket}")
    return under or exact


def _index_shards(index: Path, uri: str) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted({str(v) for v in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise RemoteCheckpointError(f"{uri.rstrip('/')}/{INDEX_FILE}: not a safetensors index (no weight_map)") from None


class _Record:
    """``.stoker-fetched.json``: name -> the object (generation, size, checksum) a file was verified against."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.entries: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def put(self, name: str, value: dict[str, Any]) -> None:
        self.entries[name] = value
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


class _Digest:
    """The object's own checksum: CRC32C when GCS has one (composite objects have no MD5), else MD5."""

    def __init__(self, blob: Any):
        self.kind, self.expected = ("crc32c", blob.crc32c) if blob.crc32c else ("md5", blob.md5_hash)
        if self.kind == "crc32c":
            import google_crc32c

            self._state: Any = google_crc32c.Checksum()
        else:
            self._state = hashlib.md5(usedforsecurity=False)

    def update(self, data: bytes) -> None:
        self._state.update(data)

    def matches(self) -> bool:
        return self.expected is None or base64.b64encode(self._state.digest()).decode() == self.expected


def _identity(blob: Any) -> dict[str, Any]:
    return {"generation": str(blob.generation), "size": int(blob.size or 0), "crc32c": blob.crc32c, "md5": blob.md5_hash}


def _hash_file(path: Path, digest: _Digest, limit: int | None = None) -> None:
    left = limit if limit is not None else path.stat().st_size
    with open(path, "rb") as handle:
        while left > 0:
            data = handle.read(min(CHUNK_BYTES, left))
            if not data:
                break
            digest.update(data)
            left -= len(data)


def _fetch_object(uri: str, bucket: Any, blob: Any, target: Path, record: _Record, name: str, report: FetchReport) -> None:
    from google.api_core.exceptions import GoogleAPICallError

    identity = _identity(blob)
    size = identity["size"]
    where = f"gs://{bucket.name}/{blob.name}"
    have = target.stat().st_size if target.is_file() else None
    if have == size and record.entries.get(name) == identity:
        report.skipped += 1
        return
    if have == size:  # a file from an earlier run with no record: keep it if its checksum matches
        digest = _Digest(blob)
        _hash_file(target, digest)
        if digest.matches():
            record.put(name, identity)
            report.skipped += 1
            return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial_of = partial.with_name(partial.name + ".json")
    digest = _Digest(blob)
    offset = 0
    if partial.is_file() and _read_json(partial_of).get("generation") == identity["generation"]:
        offset = min(partial.stat().st_size, size)
        _hash_file(partial, digest, offset)
        if offset:
            _log.info("%s: resuming at %s of %s", where, _size(offset), _size(size))
    else:
        partial_of.write_text(json.dumps({"generation": identity["generation"]}))
    pinned = bucket.blob(blob.name, generation=blob.generation)  # a replaced object fails, not mixes
    started, last = time.monotonic(), time.monotonic()
    first = offset
    with open(partial, "r+b" if offset else "wb") as out:
        out.truncate(offset)
        out.seek(offset)
        while offset < size:
            end = min(offset + CHUNK_BYTES, size) - 1
            buffer = io.BytesIO()
            try:
                pinned.download_to_file(buffer, start=offset, end=end, raw_download=True, checksum=None)
            except GoogleAPICallError as exc:
                raise _explain_object(where, bucket.name, exc) from None
            data = buffer.getvalue()
            if len(data) != end - offset + 1:
                raise RemoteCheckpointError(f"{where}: got {len(data)} bytes for range {offset}-{end}; the object changed?")
            digest.update(data)
            out.write(data)
            offset += len(data)
            now = time.monotonic()
            if now - last >= PROGRESS_SECONDS and offset < size:
                rate = (offset - first) / max(now - started, 1e-9)
                _log.info("%s: %s of %s (%.0f%%), %s/s", where, _size(offset), _size(size), 100 * offset / size, _size(rate))
                last = now
    if not digest.matches():
        partial.unlink(missing_ok=True)
        raise RemoteCheckpointError(f"{where}: {digest.kind} of the download differs from the object's; removed, retry")
    os.replace(partial, target)
    partial_of.unlink(missing_ok=True)
    record.put(name, identity)
    report.downloaded += 1
    report.bytes += size - first
    if size >= CHUNK_BYTES:
        _log.info("%s: complete, %s moved in %.0f s", where, _size(size - first), time.monotonic() - started)


def _explain_object(where: str, bucket: str, exc: Exception) -> RemoteCheckpointError:
    from google.api_core.exceptions import NotFound

    if isinstance(exc, NotFound):
        return RemoteCheckpointError(f"{where}: not found (deleted or replaced while fetching)")
    return _explain(where, bucket, exc)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ------------------------------------------------------------------- the manifest's checkpoints


@dataclass(frozen=True)
class FetchPlan:
    """Which of a manifest's gs:// checkpoints a process fetches before it reads the spec."""

    weights: bool = True  # model.checkpoint's weight files (the actors need only its config and tokenizer)
    teacher: bool = False  # algorithm.teacher.checkpoint (the learner's)


LEARNER = FetchPlan(weights=True, teacher=True)
ROLLOUT = FetchPlan(weights=True, teacher=False)
ACTOR = FetchPlan(weights=False, teacher=False)


def _section(parent: Any, key: str) -> dict[str, Any]:
    value = parent.get(key) if isinstance(parent, dict) else None
    return value if isinstance(value, dict) else {}


def localize_document(doc: Any, plan: FetchPlan, fetcher: Callable[..., FetchReport] = fetch) -> tuple[Any, list[tuple[str, str]]]:
    """The RLJob document with its gs:// checkpoint fields replaced by local copies, and the
    problems as (field path under spec, one-line message)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict):
        return doc, []
    out = json.loads(json.dumps(doc))  # a copy; the caller's document stays as written
    model = _section(out["spec"], "model")
    teacher = _section(_section(out["spec"], "algorithm"), "teacher")
    fields: list[tuple[str, dict[str, Any], str, bool]] = [
        ("model.checkpoint", model, "checkpoint", plan.weights),
        ("model.tokenizer", model, "tokenizer", True),
    ]
    if plan.teacher:
        fields.append(("algorithm.teacher.checkpoint", teacher, "checkpoint", True))
    problems: list[tuple[str, str]] = []
    for path, section, key, weights in fields:
        value = section.get(key)
        if not isinstance(value, str) or not is_remote(value):
            continue
        try:
            section[key] = str(fetcher(value, weights=weights).path)
        except RemoteCheckpointError as exc:
            problems.append((path, str(exc)))
    return out, problems


def remote_uris(spec: Any, plan: FetchPlan) -> list[str]:
    """The gs:// URIs of an ``RLJobSpec`` that a process with ``plan`` fetches (the operator mounts
    a cache volume for them)."""
    model = spec.model
    values = [model.checkpoint, model.tokenizer]
    if plan.teacher and spec.algorithm.teacher is not None:
        values.append(spec.algorithm.teacher.checkpoint)
    return [v for v in values if is_remote(v)]
