"""Sharded weights: one learner process's publish and serve throughput, one reader's fetch
throughput, against the single blob's gRPC fetch (the baseline) in the same run.

    .venv/bin/python benchmarks/weights_shards.py [--repeats 5]

For each parameter set a ``ShardedPublisher`` (one process, one device: every shard is this
process's) publishes one version to a directory on local disk and to its own gRPC server; then,
alternating calls so load drift hits all alike:

* blob gRPC: ``WeightSubscriber.fetch`` from a ``WeightPublisher`` (transfer, sha256, decode);
* shards gRPC: every tensor read by slice from the process's ``ShardServer`` (``ReadShard``
  streams, crc32 per block, assembly);
* shards directory: the same from the shared directory (page cache: a reader's own ceiling).

Each against the path before the per-process cuts, in the same run ("old"): publishing one
shard at a time, transposed on the host, fsynced file by file (``old_publish`` below); reading
each shard as one stream of 1 MiB chunks. The fan-out model in docs/sizing.md takes its
per-process figures from these.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

import numpy as np

from stoker.distributed import Processes
from stoker.learner.publish import ShardedPublisher, plan
from stoker.model import shards as shards_module
from stoker.model.model import count_params, init_model
from stoker.model.shard_service import ShardServer
from stoker.model.shards import BLOCK_BYTES, ShardedWeights, block_rows, checksums
from stoker.model.weights import WeightPublisher, WeightSubscriber, flatten_params
from stoker.spec import TransformerConfig

SETS = {
    "~50 MB f32": (TransformerConfig(
        vocab_size=8192, hidden_size=512, num_layers=3, num_heads=8, num_kv_heads=4, intermediate_size=1408
    ), jnp.float32),
    "~200 MB bf16": (TransformerConfig(
        vocab_size=16384, hidden_size=1024, num_layers=5, num_heads=16, num_kv_heads=8, intermediate_size=2816
    ), jnp.bfloat16),
}


def timed(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall seconds of each of ``fns``, called in turn ``repeats`` times after a warm-up."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def old_publish(model: object, directory: Path, server: ShardServer, version: int) -> None:
    """The staging loop before the cuts: sequential, host transpose, fsync per file."""
    shards, _ = plan(model)
    where = directory / f"old-{version}"
    where.mkdir(parents=True, exist_ok=True)
    for shard in shards:
        data = {s.device: s.data for s in shard.array.addressable_shards}[shard.device]
        host = np.asarray(data)
        if shard.transpose:
            host = np.ascontiguousarray(host.T)
        checksums(host, block_rows(host.shape, host.dtype.itemsize, BLOCK_BYTES))
        with open(where / shard.key, "wb") as f:
            f.write(shards_module.as_bytes(host))
            f.flush()
            os.fsync(f.fileno())
        server.servicer.stage(version, shard.key, host)


def read_all(weights: ShardedWeights) -> int:
    parts = weights.read_boxes([(t.name, tuple((0, n) for n in t.shape)) for t in weights.manifest.tensors.values()])
    return sum(p.nbytes for p in parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        "| parameter set | params | MB | publish s (dir + server) | publish MB/s | blob gRPC fetch MB/s "
        "| shards gRPC fetch MB/s | shards directory fetch MB/s | shards gRPC / blob gRPC time "
        "| old publish MB/s | new / old publish time | old shards gRPC fetch MB/s | new / old gRPC fetch time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, (config, dtype) in SETS.items():
        model = init_model(config, seed=0, dtype=dtype)
        flat = flatten_params(model)
        with tempfile.TemporaryDirectory() as tmp:
            with (
                ShardedPublisher(directory=str(Path(tmp) / "shards"), address="127.0.0.1:0", processes=Processes(), keep=8) as shards,
                WeightPublisher(address="127.0.0.1:0") as blob,
            ):
                old_server = ShardServer("127.0.0.1:0", keep=2, chunk_bytes=1 << 20)
                publish_times, old_times = [], []
                for version in range(1, args.repeats + 1):  # alternating, so load drift hits both
                    start = time.perf_counter()
                    manifest = shards.publish(version, model)
                    publish_times.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    old_publish(model, Path(tmp), old_server, version)
                    old_times.append(time.perf_counter() - start)
                assert manifest is not None
                old_server.servicer.commit(manifest)
                assert manifest is not None
                mb = manifest.nbytes / 1e6
                blob.publish(1, flat)
                latest = args.repeats
                with (
                    WeightSubscriber(address=f"127.0.0.1:{blob.port}") as blob_sub,
                    WeightSubscriber(address=f"127.0.0.1:{shards.port}") as peer_sub,
                    WeightSubscriber(directory=Path(tmp) / "shards") as dir_sub,
                ):
                    peer_sub.latest()
                    got = peer_sub.fetch(latest)
                    assert all(got[k].tobytes() == flat[k].tobytes() for k in flat)
                    old_sub = WeightSubscriber(address=f"127.0.0.1:{old_server.port}")

                    def old_read() -> int:
                        run_bytes, shards_module.RUN_BYTES = shards_module.RUN_BYTES, 1 << 62  # one stream per shard
                        try:
                            return read_all(old_sub.fetch(latest))  # type: ignore[arg-type]
                        finally:
                            shards_module.RUN_BYTES = run_bytes

                    old_sub.latest()
                    blob_s, peer_s, dir_s, old_peer_s = timed([
                        lambda: blob_sub.fetch(1),
                        lambda: read_all(peer_sub.fetch(latest)),  # type: ignore[arg-type]
                        lambda: read_all(dir_sub.fetch(latest)),  # type: ignore[arg-type]
                        old_read,
                    ], args.repeats)
                    old_sub.close()
                old_server.close()
        publish_s, old_s = statistics.median(publish_times), statistics.median(old_times)
        print(
            f"| {label} | {count_params(model):,} | {mb:.1f} | {publish_s:.3f} | {mb / publish_s:.0f} | {mb / blob_s:.0f} "
            f"| {mb / peer_s:.0f} | {mb / dir_s:.0f} | {peer_s / blob_s:.2f} "
            f"| {mb / old_s:.0f} | {publish_s / old_s:.2f} | {mb / old_peer_s:.0f} | {peer_s / old_peer_s:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
