"""Weight channel throughput: gRPC chunked streaming vs a shared directory, in the same run.

    .venv/bin/python benchmarks/weights_channel.py [--repeats 7] [--chunks 262144,1048576,4194304]

For each parameter set (the tiny FrozenLake policy and a ~50 MB one) it publishes a version through
a ``WeightPublisher`` serving both transports, then times ``WeightSubscriber.fetch`` end to end
(transfer, size + sha256 check, safetensors decode) over loopback gRPC and from the directory.
The directory sits on local disk, so its reads come from the page cache: it stands for the best
case of a shared volume, and the ratio is gRPC's cost relative to that.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from stoker.model.model import count_params, init_model
from stoker.weights.channel import WeightPublisher, WeightSubscriber, flatten_params
from stoker.spec import TransformerConfig

SETS = {
    "tiny (FrozenLake default)": TransformerConfig(),
    "~50 MB": TransformerConfig(
        vocab_size=8192, hidden_size=512, num_layers=3, num_heads=8, num_kv_heads=4, intermediate_size=1408
    ),
}


def interleaved(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall seconds of ``a`` and of ``b``, alternating calls so load drift hits both alike."""
    a(), b()  # warm-up
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(repeats):
        for fn, out in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunks", default="262144,1048576,4194304", help="gRPC chunk sizes in bytes")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]

    print(
        "| parameter set | params | MB | gRPC chunk | gRPC fetch s | gRPC MB/s | directory fetch s | directory MB/s "
        "| gRPC / directory time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, config in SETS.items():
        model = init_model(config, seed=0)
        flat = flatten_params(model)
        for chunk in chunks:
            with tempfile.TemporaryDirectory() as tmp:
                directory = Path(tmp) / "weights"
                with WeightPublisher(directory=directory, address="127.0.0.1:0", chunk_bytes=chunk) as pub:
                    info = pub.publish(1, flat)
                    mb = info.size_bytes / 1e6
                    with (
                        WeightSubscriber(address=f"127.0.0.1:{pub.port}") as grpc_sub,
                        WeightSubscriber(directory=directory) as dir_sub,
                    ):
                        got = grpc_sub.fetch(1)
                        assert all(np.array_equal(got[k], flat[k]) for k in flat)
                        grpc_s, dir_s = interleaved(
                            lambda: grpc_sub.fetch(1), lambda: dir_sub.fetch(1), args.repeats
                        )
            print(
                f"| {label} | {count_params(model):,} | {mb:.2f} | {chunk >> 10} KiB "
                f"| {grpc_s:.4f} | {mb / grpc_s:.0f} | {dir_s:.4f} | {mb / dir_s:.0f} | {grpc_s / dir_s:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
