"""One relay hop: a rollout server reading a version from the relay above it, over the relay's
plain-TCP shard stream against over its gRPC ``ReadShard``, in the same run.

    nice -n 10 .venv/bin/python benchmarks/weights_relay.py [--repeats 3]

A ``ShardedPublisher`` (one process, its stream on) publishes the ~200 MB bf16 set; an upstream
``WeightRelay`` reads it whole once from the learner and holds every block. Then, alternating,
a fresh downstream relay reads every tensor whole through its ``RelayedSource`` with that relay
as its upstream: once told the upstream's stream address (the registry's answer), once not
(gRPC only). Every byte must come from the upstream relay (checked). For reference, a plain
subscriber reads the same version from the learner's stream. All in one process, so the serving
side shares the reader's process (benchmarks/weights_shards.py's table 1 setting).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from weights_shards import SETS, read_all, timed  # noqa: E402

from stoker.distributed import Processes  # noqa: E402
from stoker.weights.publish import ShardedPublisher  # noqa: E402
from stoker.model.model import init_model  # noqa: E402
from stoker.weights.shard_relay import WeightRelay  # noqa: E402
from stoker.weights.channel import WeightSubscriber  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    label = "~200 MB bf16"
    config, dtype = SETS[label]
    with ShardedPublisher(address="127.0.0.1:0", processes=Processes(), keep=2) as publisher:
        manifest = publisher.publish(1, init_model(config, 7, dtype))
        assert manifest is not None
        learner = f"127.0.0.1:{publisher.port}"
        upstream = WeightRelay(wait_s=60.0)
        address = f"127.0.0.1:{upstream.serve('127.0.0.1:0')}"
        stream = f"127.0.0.1:{upstream.stream_server.port}"
        with WeightSubscriber(address=learner, relay=upstream) as first:
            total = read_all(first.fetch(1))  # type: ignore[arg-type]

        def hop(over_stream: bool) -> None:
            reader = WeightRelay((address,), stream_port=None, upstream_streams={address: stream} if over_stream else None)
            try:
                with WeightSubscriber(address=learner, relay=reader) as subscriber:
                    assert read_all(subscriber.fetch(1)) == total  # type: ignore[arg-type]
                name = f"relay {address}" + (" stream" if over_stream else "")
                assert reader.stats.taken == {name: total} and reader.stats.fallbacks == 0, reader.stats
            finally:
                reader.close()

        def direct() -> None:  # the learner's stream, no relay: the rate a hop could reach
            with WeightSubscriber(address=learner) as subscriber:
                assert read_all(subscriber.fetch(1)) == total  # type: ignore[arg-type]

        grpc_s, stream_s, learner_s = timed([lambda: hop(False), lambda: hop(True), direct], args.repeats)
        upstream.close()
    mb = total / 1e6
    print(f"{label}, {mb:.0f} MB, one relay hop, median of {args.repeats} (after a warm-up):")
    print("| hop | seconds | MB/s |")
    print("|---|---|---|")
    print(f"| relay over gRPC ReadShard | {grpc_s:.3f} | {mb / grpc_s:.0f} |")
    print(f"| relay over the shard stream | {stream_s:.3f} | {mb / stream_s:.0f} |")
    print(f"| the learner's stream, no relay | {learner_s:.3f} | {mb / learner_s:.0f} |")
    print(f"stream/gRPC time: {stream_s / grpc_s:.2f}; relay stream/learner stream time: {stream_s / learner_s:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
