"""Where a sharded publish's and a sharded read's time goes, stage by stage, in one process.

    nice -n 10 .venv/bin/python benchmarks/weights_profile.py [--repeats 3]

The ~200 MB bf16 set of ``weights_shards.py``, one device. Each stage is timed alone over every
shard (serially, so the sums add up to a one-thread cost; the real publish runs 4 writers):

* publish: on-device transpose + device-to-host copy, crc32 per block, unsynced file write, fsync;
* gRPC read (``PeerShards`` over loopback): the server's per-chunk ``bytes`` copy and message
  build, protobuf (de)serialization of a chunk, the whole ``ReadShard`` stream alone, the
  client's join, crc32, assembly (concatenate + copy into the tensor), ``jax.device_put``;
* the same raw bytes over the plain-TCP stream (``stoker.weights.shard_stream``), for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from stoker.distributed import Processes
from stoker.weights.publish import ShardedPublisher, plan
from stoker.model.model import init_model
from stoker.weights.shard_service import PeerShards
from stoker.weights.shards import BLOCK_BYTES, ShardedWeights, as_bytes, block_rows, checksums, fsync_file
from stoker.spec import TransformerConfig
from stoker.v1 import weights_pb2

CONFIG = TransformerConfig(vocab_size=16384, hidden_size=1024, num_layers=5, num_heads=16, num_kv_heads=8, intermediate_size=2816)
CHUNK = 1 << 20


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = init_model(CONFIG, seed=0, dtype=jnp.bfloat16)
    shards, _ = plan(model)
    local = [{s.device: s.data for s in p.array.addressable_shards}[p.device] for p in shards]
    hosts = [np.asarray(jnp.transpose(d) if p.transpose else d) for p, d in zip(shards, local, strict=True)]
    total = sum(h.nbytes for h in hosts)
    rows = [block_rows(h.shape, h.dtype.itemsize, BLOCK_BYTES) for h in hosts]
    stages: dict[str, float] = {}
    r = args.repeats

    def d2h() -> None:
        for p, d in zip(shards, local, strict=True):
            np.asarray(jnp.transpose(d) if p.transpose else d)

    def d2h_plain() -> None:
        for d in local:
            np.asarray(d)

    stages["publish: device->host copy (no transpose)"] = best(d2h_plain, r)
    stages["publish: on-device transpose + device->host copy"] = best(d2h, r)
    stages["publish: crc32 per block"] = best(lambda: [checksums(h, n) for h, n in zip(hosts, rows, strict=True)], r)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"s{i}" for i in range(len(hosts))]

        def write() -> None:
            for h, path in zip(hosts, paths, strict=True):
                with open(path, "wb") as f:
                    f.write(as_bytes(h))

        stages["publish: file write (unsynced)"] = best(write, r)

        def write_sync() -> None:
            write()
            for path in paths:
                fsync_file(path)

        stages["publish: file write + fsync"] = best(write_sync, r)
        with ShardedPublisher(directory=str(Path(tmp) / "d"), address="127.0.0.1:0", processes=Processes(), keep=r + 2) as pub:
            versions = iter(range(1, 100))
            stages["publish: ShardedPublisher.publish (4 writers, dir + server)"] = best(lambda: pub.publish(next(versions), model), r)
            manifest = pub.publish(next(versions), model)
            assert manifest is not None

            def serve_chunks() -> None:  # what the servicer does per chunk, without the wire
                for h in hosts:
                    view = as_bytes(h)
                    for at in range(0, len(view), CHUNK):
                        weights_pb2.WeightsChunk(policy_version=1, offset=at, data=bytes(view[at : at + CHUNK])).SerializeToString()

            stages["read: server bytes() copy + chunk build + serialize"] = best(serve_chunks, r)
            wire = [weights_pb2.WeightsChunk(policy_version=1, offset=0, data=bytes(CHUNK)).SerializeToString()] * (total // CHUNK)
            stages["read: client chunk parse (protobuf)"] = best(lambda: [weights_pb2.WeightsChunk.FromString(w).data for w in wire], r)
            peers = PeerShards()
            records = [s for t in manifest.tensors.values() for s in t.shards]
            sizes = {p.key: h.nbytes for p, h in zip(shards, hosts, strict=True)}

            def stream_only() -> None:
                for s in records:
                    for _ in peers.stream(manifest, s, 0, sizes[s.key]):
                        pass

            stages["read: ReadShard streams alone (1 thread, chunks dropped)"] = best(stream_only, r)
            stages["read: ReadShard + b''.join (1 thread)"] = best(lambda: [peers.read(manifest, s, 0, sizes[s.key]) for s in records], r)
            stages["read: crc32 of every block"] = best(lambda: [zlib.crc32(as_bytes(h)) for h in hosts], r)
            weights = ShardedWeights(manifest, peers)
            boxes = [(t.name, tuple((0, n) for n in t.shape)) for t in manifest.tensors.values()]
            stages["read: ShardedWeights.read_boxes over gRPC (8 threads, all in)"] = best(lambda: weights.read_boxes(boxes), r)
            blocks = [np.array_split(h, max(1, h.shape[0] // n)) for h, n in zip(hosts, rows, strict=True)]
            out = [np.empty_like(h) for h in hosts]

            def assemble() -> None:
                for parts, o in zip(blocks, out, strict=True):
                    o[...] = np.concatenate(parts)

            stages["read: assembly (concatenate + copy into the tensor)"] = best(assemble, r)
            device = jax.devices()[0]
            stages["read: jax.device_put of every tensor"] = best(
                lambda: [jax.device_put(h, device).block_until_ready() for h in hosts], r)
            try:
                from stoker.weights.shard_stream import StreamShards

                streams = StreamShards(token=None)
                stages["read: plain-TCP stream (1 thread, crc checked)"] = best(
                    lambda: [streams.read(manifest, s, 0, sizes[s.key]) for s in records], r)
                sweights = ShardedWeights(manifest, streams)
                stages["read: ShardedWeights.read_boxes over the stream (8 threads, all in)"] = best(lambda: sweights.read_boxes(boxes), r)
                streams.close()
            except ImportError:
                pass
            peers.close()
    print(f"{total / 1e6:.0f} MB in {len(hosts)} shards, median of {r}; load {os.getloadavg()[0]:.1f}")
    print("| stage | s | MB/s |\n|---|---|---|")
    for name, s in stages.items():
        print(f"| {name} | {s:.3f} | {total / 1e6 / s:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
