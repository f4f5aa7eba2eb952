"""A relay hop with every stage in its own process, pipelined: the learner serves a version, a
cold relay reads it from the learner while a reader reads it from that relay, block by block as
each arrives. The relay's ingest and its serving share its one process (the worst case
docs/sizing.md brackets); the reference is the same reader taking the version straight from the
learner's stream, alternated in the same run.

    nice -n 10 .venv/bin/python benchmarks/relay_chain.py [--repeats 3]

Processes: the learner (``weights_shards.py --serve``: a ``ShardedPublisher`` with its stream),
a fresh relay per repeat (``--relay``: a ``WeightRelay`` serving over gRPC and its stream, which
starts reading when told), and this one, the reader: a ``WeightRelay`` whose only upstream is
that relay's stream. Every byte the reader takes must come from the relay (checked), so a hop
that fell back to the learner cannot pass as fast. On this 2-core VM all three processes share
two cores; on a cluster each is its own host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from weights_shards import SETS, cpu_seconds, read_all  # noqa: E402

from stoker.weights.shard_relay import WeightRelay  # noqa: E402
from stoker.weights.channel import WeightSubscriber  # noqa: E402

LABEL = "~200 MB bf16"


def wait_for(path: Path, proc: subprocess.Popen[bytes], what: str) -> dict[str, float]:
    deadline = time.monotonic() + 300
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return dict(json.loads(path.read_text()))


def relay(learner: str, out: Path) -> int:
    """``--relay``: serve, then on a line from stdin read version 1 from the learner through the
    relay's cache; report its seconds and CPU; exit when stdin closes."""
    node = WeightRelay(wait_s=60.0)
    port = node.serve("127.0.0.1:0")
    (out / "relay.json").write_text(json.dumps({"port": port, "stream": node.stream_server.port}))
    sys.stdin.readline()
    start, cpu = time.perf_counter(), cpu_seconds()
    with WeightSubscriber(address=learner, relay=node) as subscriber:
        total = read_all(subscriber.fetch(1))  # type: ignore[arg-type]
    ingest_s = time.perf_counter() - start
    sys.stdin.read()  # the reader may still be taking the last blocks
    (out / "relay-done.json").write_text(json.dumps({"ingest_s": ingest_s, "bytes": total, "cpu_s": cpu_seconds() - cpu}))
    node.close()
    return 0


def chained(learner: str, total: int) -> tuple[float, float, float]:
    """One pipelined hop: (reader seconds, relay ingest seconds, relay CPU seconds per GB)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, __file__, "--relay", learner, tmp], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        try:
            ports = wait_for(Path(tmp) / "relay.json", proc, "the relay")
            address, stream = f"127.0.0.1:{ports['port']:.0f}", f"127.0.0.1:{ports['stream']:.0f}"
            reader = WeightRelay((address,), stream_port=None, upstream_streams={address: stream})
            try:
                with WeightSubscriber(address=learner, relay=reader) as subscriber:
                    weights = subscriber.fetch(1)
                    proc.stdin.write(b"go\n")
                    proc.stdin.flush()
                    start = time.perf_counter()
                    assert read_all(weights) == total  # type: ignore[arg-type]
                    seconds = time.perf_counter() - start
                name = f"relay {address} stream"
                assert reader.stats.taken == {name: total} and reader.stats.fallbacks == 0, reader.stats
            finally:
                reader.close()
            proc.stdin.close()
            done = wait_for(Path(tmp) / "relay-done.json", proc, "the relay's report")
            assert done["bytes"] == total
            return seconds, done["ingest_s"], done["cpu_s"] / (total / 1e9)
        finally:
            if not proc.stdin.closed:  # failed before the relay was told to finish
                proc.kill()
            proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--relay", nargs=2, metavar=("LEARNER", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay:
        return relay(args.relay[0], Path(args.relay[1]))
    assert LABEL in SETS
    with tempfile.TemporaryDirectory() as tmp:
        serving = Path(__file__).resolve().parent / "weights_shards.py"
        learner_proc = subprocess.Popen([sys.executable, str(serving), "--serve", LABEL, tmp], stdin=subprocess.PIPE)
        try:
            learner = f"127.0.0.1:{wait_for(Path(tmp) / 'serving.json', learner_proc, 'the learner')['port']:.0f}"
            with WeightSubscriber(address=learner) as subscriber:
                total = read_all(subscriber.fetch(1))  # type: ignore[arg-type]  # also the warm-up
            direct, hops = [], []
            for _ in range(args.repeats):
                with WeightSubscriber(address=learner) as subscriber:
                    weights = subscriber.fetch(1)
                    start = time.perf_counter()
                    assert read_all(weights) == total  # type: ignore[arg-type]
                    direct.append(time.perf_counter() - start)
                hops.append(chained(learner, total))
        finally:
            assert learner_proc.stdin is not None
            learner_proc.stdin.close()
            learner_proc.wait(60)
    mb = total / 1e6
    hop_s, ingest_s, relay_cpu = (statistics.median(h[i] for h in hops) for i in range(3))
    direct_s = statistics.median(direct)
    print(f"{LABEL}, {mb:.0f} MB, median of {args.repeats}; every stage its own process:\n")
    print("| read | seconds | MB/s |")
    print("|---|---|---|")
    print(f"| reader from the learner's stream (no relay) | {direct_s:.3f} | {mb / direct_s:.0f} |")
    print(f"| cold relay from the learner (its ingest, while serving) | {ingest_s:.3f} | {mb / ingest_s:.0f} |")
    print(f"| reader from that relay, pipelined | {hop_s:.3f} | {mb / hop_s:.0f} |")
    print(f"\npipelined hop / direct time: {hop_s / direct_s:.2f}; relay CPU (ingest + serve): {relay_cpu:.2f} s/GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
