"""Sharded weights: one learner process's publish (staging) rate and one reader's fetch rate over
each transport (gRPC ``ReadShard``, the plain-TCP stream, the shared directory), against the
single blob's gRPC fetch, in the same run.

    nice -n 10 .venv/bin/python benchmarks/weights_shards.py [--repeats 5]

For each parameter set a ``ShardedPublisher`` (one process, one device: every shard is this
process's) publishes versions alternately to its own servers only (what the peer/relay path
stages) and to a directory on local disk as well. Then, alternating calls so load drift hits all
alike, every tensor is read whole by slice (crc32 per block, assembly) from:

* blob gRPC: ``WeightSubscriber.fetch`` from a ``WeightPublisher`` (transfer, sha256, decode);
* shards gRPC: the process's ``ShardServer`` (``WeightSubscriber(stream=False)``);
* shards stream: the same shards over its plain-TCP stream (``stoker.weights.shard_stream``, the
  subscriber's default);
* shards directory: the shared directory (page cache: a reader's own ceiling).

Twice: with the servers in the reader's own process (table 1), and in a separate process
(``--serve``, table 2: the reader's process does only the reading). Table 2 also reads the same
number of bytes over one raw TCP connection from the serving process (``recv_into`` one reused
16 MiB buffer, with and without crc32 per 4 MiB): the loopback ceiling the stream is held to.
docs/sizing.md's fan-out model takes its per-process rates from these.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import struct
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

from stoker.distributed import Processes
from stoker.weights.publish import ShardedPublisher
from stoker.model.model import count_params, init_model
from stoker.weights.shards import BLOCK_BYTES, RUN_BYTES, ShardedWeights, crc32
from stoker.weights.channel import WeightPublisher, WeightSubscriber, flatten_params
from stoker.spec import TransformerConfig
from stoker.procstat import proc_stat

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


def read_all(weights: ShardedWeights) -> int:
    parts = weights.read_boxes([(t.name, tuple((0, n) for n in t.shape)) for t in weights.manifest.tensors.values()])
    return sum(p.nbytes for p in parts)


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (or of ``pid``, from /proc)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_server() -> int:
    """A plain TCP sender in this process: for each 8-byte size it is sent, that many bytes from
    memory. Returns its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    data = memoryview(bytes(RUN_BYTES))

    def serve(conn: socket.socket) -> None:
        with conn:
            while len(head := conn.recv(8, socket.MSG_WAITALL)) == 8:
                (left,) = struct.unpack(">Q", head)
                while left:
                    n = min(left, len(data))
                    conn.sendall(data[:n])
                    left -= n

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1])


def raw_reader(port: int, total: int, check: bool) -> Callable[[], int]:
    """Read ``total`` bytes over one raw connection into one reused buffer (crc32 per block if
    ``check``): what any reader of this loopback must pay at least."""
    conn = socket.create_connection(("127.0.0.1", port))
    buffer = memoryview(bytearray(RUN_BYTES))

    def read() -> int:
        conn.sendall(struct.pack(">Q", total))
        left = total
        while left:
            n, got = min(left, len(buffer)), 0
            while got < n:
                got += conn.recv_into(buffer[got:n])
            if check:
                for at in range(0, n, BLOCK_BYTES):
                    crc32(buffer[at : min(at + BLOCK_BYTES, n)])
            left -= n
        return total

    return read


def reads(address: str, directory: Path, version: int, repeats: int, server: int | None = None,
          raw_port: int | None = None) -> list[tuple[float, float, float]]:
    """For gRPC, the stream and the directory (and, given ``raw_port``, the raw TCP ceiling
    without and with crc32): median seconds to read ``version`` whole, and the reader's (and the
    serving process's, given its pid) CPU seconds per GB over 3 more reads."""
    with (
        WeightSubscriber(address=address, stream=False) as grpc_sub,
        WeightSubscriber(address=address) as stream_sub,
        WeightSubscriber(directory=directory) as dir_sub,
    ):
        for sub in (grpc_sub, stream_sub):
            sub.latest()
        streamed = stream_sub.fetch(version)
        assert type(streamed.source).__name__ == "StreamShards", streamed.source  # type: ignore[attr-defined]
        fns: list[Callable[[], int]] = [
            lambda: read_all(grpc_sub.fetch(version)),  # type: ignore[arg-type]
            lambda: read_all(stream_sub.fetch(version)),  # type: ignore[arg-type]
            lambda: read_all(dir_sub.fetch(version)),  # type: ignore[arg-type]
        ]
        if raw_port is not None:
            total = streamed.manifest.nbytes  # type: ignore[attr-defined]
            fns += [raw_reader(raw_port, total, check=False), raw_reader(raw_port, total, check=True)]
        seconds = timed(fns, repeats)  # type: ignore[arg-type]
        out = []
        for fn, s in zip(fns, seconds, strict=True):
            mine, theirs = cpu_seconds(), cpu_seconds(server) if server else 0.0
            gb = sum(fn() for _ in range(3)) / 1e9
            out.append((s, (cpu_seconds() - mine) / gb, ((cpu_seconds(server) - theirs) / gb) if server else 0.0))
        assert streamed.source.fallbacks == 0  # type: ignore[attr-defined]
    return out


def serve(label: str, out: Path) -> int:
    """``--serve``: publish ``label``'s set once and serve it until stdin closes."""
    config, dtype = SETS[label]
    model = init_model(config, seed=0, dtype=dtype)
    with ShardedPublisher(directory=str(out / "shards"), address="127.0.0.1:0", processes=Processes()) as publisher:
        publisher.publish(1, model)
        (out / "serving.json").write_text(json.dumps({"port": publisher.port, "raw": raw_server()}))
        sys.stdin.read()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve", nargs=2, metavar=("SET", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve[0], Path(args.serve[1]))
    print(f"load average {os.getloadavg()[0]:.1f}, median of {args.repeats}")
    print("\nTable 1: servers in the reader's process\n")
    print(
        "| parameter set | params | MB | publish MB/s (servers) | publish MB/s (dir + servers) | blob gRPC fetch MB/s "
        "| shards gRPC MB/s | shards stream MB/s | shards directory MB/s | stream / gRPC time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, (config, dtype) in SETS.items():
        model = init_model(config, seed=0, dtype=dtype)
        flat = flatten_params(model)
        with tempfile.TemporaryDirectory() as tmp:
            with (
                ShardedPublisher(address="127.0.0.1:0", processes=Processes(), keep=2) as served,
                ShardedPublisher(directory=str(Path(tmp) / "shards"), address="127.0.0.1:0", processes=Processes(), keep=2) as both,
                WeightPublisher(address="127.0.0.1:0") as blob,
            ):
                served_s, both_s = [], []
                for version in range(1, args.repeats + 2):  # alternating, so load drift hits both
                    for publisher, times in ((served, served_s), (both, both_s)):
                        start = time.perf_counter()
                        manifest = publisher.publish(version, model)
                        times.append(time.perf_counter() - start)
                assert manifest is not None
                mb = manifest.nbytes / 1e6
                blob.publish(1, flat)
                with WeightSubscriber(address=f"127.0.0.1:{blob.port}") as blob_sub:
                    blob_s = timed([lambda: blob_sub.fetch(1)], args.repeats)[0]
                (grpc_s, _, _), (stream_s, _, _), (dir_s, _, _) = reads(
                    f"127.0.0.1:{both.port}", Path(tmp) / "shards", args.repeats + 1, args.repeats)
        pub_served, pub_both = statistics.median(served_s[1:]), statistics.median(both_s[1:])
        print(
            f"| {label} | {count_params(model):,} | {mb:.1f} | {mb / pub_served:.0f} | {mb / pub_both:.0f} | {mb / blob_s:.0f} "
            f"| {mb / grpc_s:.0f} | {mb / stream_s:.0f} | {mb / dir_s:.0f} | {stream_s / grpc_s:.2f} |"
        )
    print("\nTable 2: servers in a separate process (the reader's process only reads)\n")
    print(
        "| parameter set | MB | shards gRPC MB/s | shards stream MB/s | shards directory MB/s | stream / gRPC time "
        "| raw TCP MB/s: plain, + crc32 | stream / raw+crc32 rate | reader CPU s/GB: gRPC, stream, directory, raw, raw+crc32 "
        "| server CPU s/GB: gRPC, stream |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label in SETS:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.Popen([sys.executable, __file__, "--serve", label, tmp], stdin=subprocess.PIPE)
            try:
                deadline = time.monotonic() + 300
                while not (Path(tmp) / "serving.json").exists():
                    assert proc.poll() is None and time.monotonic() < deadline, "the serving process did not start"
                    time.sleep(0.1)
                serving = json.loads((Path(tmp) / "serving.json").read_text())
                port = serving["port"]
                with WeightSubscriber(address=f"127.0.0.1:{port}") as probe:
                    mb = probe.fetch(1).manifest.nbytes / 1e6  # type: ignore[attr-defined]
                (grpc_s, grpc_c, grpc_sc), (stream_s, stream_c, stream_sc), (dir_s, dir_c, _), (raw_s, raw_c, _), (crc_s, crc_c, _) = reads(
                    f"127.0.0.1:{port}", Path(tmp) / "shards", 1, args.repeats, proc.pid, serving["raw"])
            finally:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(60)
        print(
            f"| {label} | {mb:.1f} | {mb / grpc_s:.0f} | {mb / stream_s:.0f} | {mb / dir_s:.0f} | {stream_s / grpc_s:.2f} "
            f"| {mb / raw_s:.0f}, {mb / crc_s:.0f} | {crc_s / stream_s:.2f} "
            f"| {grpc_c:.2f}, {stream_c:.2f}, {dir_c:.2f}, {raw_c:.2f}, {crc_c:.2f} | {grpc_sc:.2f}, {stream_sc:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
