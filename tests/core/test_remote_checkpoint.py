"""gs:// checkpoints fetched into the local cache, against a real fake GCS server on loopback
(gcp-storage-emulator, driven by the real google-cloud-storage client)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from stoker import remote_checkpoint
from stoker.checkpoint_files import expected_tensors
from stoker.hfconfig import config_from_hf
from stoker.manifest import ManifestError, load_job
from stoker.remote_checkpoint import ACTOR, LEARNER, MARKER, RemoteCheckpointError, fetch

QWEN2: dict[str, object] = {
    "model_type": "qwen2", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 24, "max_position_embeddings": 1024, "tie_word_embeddings": False,
}
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """A fake GCS server with an empty bucket "models"; the client of ``stoker.remote_checkpoint``
    talks to it (STORAGE_EMULATOR_HOST) and the cache is under tmp_path."""
    from gcp_storage_emulator.server import create_server
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket="models")
    server.start()
    port = server._api._httpd.server_address[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv(remote_checkpoint.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(remote_checkpoint, "CHUNK_BYTES", 4096)  # several ranged requests per shard
    try:
        yield storage.Client(project="test", credentials=AnonymousCredentials()).bucket("models")
    finally:
        server.stop()


def _checkpoint(directory: Path) -> dict[str, bytes]:
    """A tiny Qwen2 checkpoint in three shards with its index, config and tokenizer files."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in expected_tensors(config_from_hf(QWEN2)).items()}
    names = sorted(tensors)
    weight_map = {}
    for index, shard in enumerate(SHARDS):
        part = names[index::3]
        save_file({n: tensors[n] for n in part}, str(directory / shard))
        weight_map |= {n: shard for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(QWEN2))
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel"}}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def _upload(bucket: Any, prefix: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        bucket.blob(f"{prefix}/{name}").upload_from_string(data)


def _manifest(tmp_path: Path, checkpoint: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nmetadata: {name: tiny}\n"
        f"spec:\n  model:\n    checkpoint: {checkpoint}\n  environment: {{name: swe}}\n"
    )
    return path


def test_a_sharded_gs_checkpoint_is_fetched_once_and_loads_like_a_local_one(gcs: Any, tmp_path: Path) -> None:
    files = _checkpoint(tmp_path / "src")
    _upload(gcs, "qwen/v1", files)
    # What repositories carry beside the checkpoint and Stoker never reads: not fetched.
    _upload(gcs, "qwen/v1", {"pytorch_model.bin": b"torch pickle", "original/params.json": b"{}"})
    job = load_job(_manifest(tmp_path, "gs://models/qwen/v1"), fetch=LEARNER)
    local = tmp_path / "cache" / "models" / "qwen" / "v1"
    assert job.spec.model.checkpoint == str(local)
    assert job.spec.model.architecture.vocab_size == 40 and job.spec.model.architecture.hidden_size == 16  # config.json read
    assert {p.name: p.read_bytes() for p in local.iterdir() if p.name != MARKER} == files  # every byte, nothing else

    again = fetch("gs://models/qwen/v1")  # a restarted process: everything is complete, nothing moves
    assert (again.downloaded, again.skipped, again.bytes) == (0, len(files), 0)
    assert not (local / "original").exists()

    changed = files[SHARDS[1]][:-8] + b"\x00" * 8  # a new generation of one shard: only it comes again
    gcs.blob(f"qwen/v1/{SHARDS[1]}").upload_from_string(changed)
    again = fetch("gs://models/qwen/v1")
    assert (again.downloaded, again.skipped) == (1, len(files) - 1)
    assert (local / SHARDS[1]).read_bytes() == changed


def test_a_cut_download_resumes_and_a_wrong_file_is_replaced(
    gcs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(remote_checkpoint, "PROGRESS_SECONDS", 0.0)  # a progress line per chunk
    files = _checkpoint(tmp_path / "src")
    _upload(gcs, "qwen", files)
    blob = gcs.get_blob(f"qwen/{SHARDS[0]}")
    local = tmp_path / "cache" / "models" / "qwen"
    local.mkdir(parents=True)
    half = len(files[SHARDS[0]]) // 2
    (local / f"{SHARDS[0]}.partial").write_bytes(files[SHARDS[0]][:half])  # the pod died mid-download
    (local / f"{SHARDS[0]}.partial.json").write_text(json.dumps({"generation": str(blob.generation)}))
    (local / SHARDS[1]).write_bytes(b"\xff" * len(files[SHARDS[1]]))  # same size, wrong bytes, no record
    with caplog.at_level("INFO", logger="stoker.remote_checkpoint"):
        report = fetch("gs://models/qwen")
    assert f"gs://models/qwen/{SHARDS[0]}: resuming at {half / 1024:.1f} KiB" in caplog.text
    assert f"gs://models/qwen/{SHARDS[2]}: 4.0 KiB of " in caplog.text  # progress on a file of several chunks
    assert report.bytes == sum(len(d) for d in files.values()) - half  # the first half did not move again
    assert {p.name: p.read_bytes() for p in local.iterdir() if p.name != MARKER} == files
    assert report.downloaded == len(files)


def test_a_missing_shard_bucket_or_object_is_one_line_before_any_weights_move(gcs: Any, tmp_path: Path) -> None:
    files = _checkpoint(tmp_path / "src")
    del files[SHARDS[2]]
    _upload(gcs, "broken", files)
    with pytest.raises(ManifestError) as err:
        load_job(_manifest(tmp_path, "gs://models/broken"), fetch=LEARNER)
    assert str(err.value) == (
        f"{tmp_path / 'job.yaml'}: spec.model.checkpoint: gs://models/broken/{SHARDS[2]}: not found "
        "(model.safetensors.index.json names it)"
    )
    cached = tmp_path / "cache" / "models" / "broken"
    assert not list(cached.glob("*.safetensors"))  # nothing big was downloaded

    with pytest.raises(RemoteCheckpointError, match=r"^gs://models/nothing-here: no such object or directory in gs://models$"):
        fetch("gs://models/nothing-here")
    with pytest.raises(RemoteCheckpointError, match=r"^gs://no-such-bucket/m: bucket gs://no-such-bucket does not exist$"):
        fetch("gs://no-such-bucket/m")


def test_actors_fetch_the_config_and_tokenizer_not_the_weights(gcs: Any, tmp_path: Path) -> None:
    files = _checkpoint(tmp_path / "src")
    _upload(gcs, "qwen", files)
    job = load_job(_manifest(tmp_path, "gs://models/qwen"), fetch=ACTOR)
    local = Path(job.spec.model.checkpoint or "")
    assert sorted(p.name for p in local.iterdir() if p.name != MARKER) == [
        "config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"
    ]
    assert job.spec.model.architecture.num_layers == 2


class _Denied(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # what GCS answers an account without storage.objects.list
        body = json.dumps({"error": {"code": 403, "message": "caller does not have storage.objects.list access"}})
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


def test_denied_access_names_the_role_to_grant(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Denied)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv(remote_checkpoint.CACHE_ENV, str(tmp_path / "cache"))
    try:
        with pytest.raises(ManifestError) as err:
            load_job(_manifest(tmp_path, "gs://private/qwen"), fetch=LEARNER)
    finally:
        server.shutdown()
    message = str(err.value)
    assert "\n" not in message and "spec.model.checkpoint: gs://private/qwen: access denied (403)" in message
    assert "Workload Identity" in message and "roles/storage.objectViewer on gs://private" in message


@pytest.mark.parametrize("component", ["learner", "rollout", "actor"])
def test_each_component_fetches_before_it_starts(
    gcs: Any, tmp_path: Path, component: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stoker.cli import main as stoker_main

    manifest = _manifest(tmp_path, "gs://no-such-bucket/qwen")
    required = {"learner": ["--run-dir", str(tmp_path / "run")], "actor": ["--buffer", "127.0.0.1:1"], "rollout": []}
    code = stoker_main([component, "--manifest", str(manifest), *required[component]])
    err = capsys.readouterr().err
    assert code != 0
    assert "spec.model.checkpoint: gs://no-such-bucket/qwen: bucket gs://no-such-bucket does not exist" in err
