"""One rollout server's weight relay for ``test_weight_relay.py``.

    python relay_worker.py OUT NAME LEARNER_ADDR VERSION [--relay-from ADDR[=STREAM] ...] [--discover] [--go FILE] [--no-stream]

Serves a ``WeightRelay`` on a free port (written to ``OUT/NAME.port``; its shard stream's port to
``OUT/NAME.stream`` unless ``--no-stream``), waits for ``OUT/go`` (or
``OUT/FILE``); with ``--discover`` it registers with the learner's server and reads from the
relays it names (as ``stoker rollout --weights-relay-advertise``);
reads every tensor of ``VERSION`` whole (as a one-host server with every chip does) through the
relay (its upstream relays first, the learner's servers for the rest), writes ``OUT/NAME.json``
(each tensor's bytes as hex sha256, the bytes taken per source, the fallbacks), and serves on
until ``OUT/done`` appears.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("name")
    parser.add_argument("learner")
    parser.add_argument("version", type=int)
    parser.add_argument("--relay-from", action="append", default=[])
    parser.add_argument("--discover", action="store_true")
    parser.add_argument("--go", default="go")
    parser.add_argument("--no-stream", action="store_true")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    from stoker.weights.shard_relay import WeightRelay
    from stoker.weights.channel import WeightSubscriber

    out = Path(args.out)
    upstream = [u.split("=", 1) for u in args.relay_from]
    relay = WeightRelay(tuple(u[0] for u in upstream), wait_s=60.0, stream_port=None if args.no_stream else 0,
                        upstream_streams={u[0]: u[1] for u in upstream if len(u) == 2})
    port = relay.serve("127.0.0.1:0")
    if args.discover:
        relay.registry, relay.advertise = args.learner, f"127.0.0.1:{port}"
    if relay.stream_server is not None:
        (out / f"{args.name}.stream.tmp").write_text(str(relay.stream_server.port))
        (out / f"{args.name}.stream.tmp").rename(out / f"{args.name}.stream")
    (out / f"{args.name}.port.tmp").write_text(str(port))
    (out / f"{args.name}.port.tmp").rename(out / f"{args.name}.port")
    deadline = time.monotonic() + 120
    while not (out / args.go).exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # the test starts every relay's read together (a pipelined chain)
    with WeightSubscriber(address=args.learner, relay=relay) as subscriber:
        weights = subscriber.fetch(args.version)
        names = list(weights.manifest.tensors)  # type: ignore[attr-defined]
        parts = weights.read_boxes([(n, tuple((0, d) for d in weights.manifest.tensors[n].shape)) for n in names])  # type: ignore[attr-defined]
    result = {
        "sha256": {n: hashlib.sha256(p.tobytes()).hexdigest() for n, p in zip(names, parts, strict=True)},
        "taken": relay.stats.taken, "fallbacks": relay.stats.fallbacks,
        "upstream": {str(v): list(u) for v, u in relay.stats.upstream.items()},
    }
    (out / f"{args.name}.json.tmp").write_text(json.dumps(result))
    (out / f"{args.name}.json.tmp").rename(out / f"{args.name}.json")
    deadline = time.monotonic() + 120
    while not (out / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # serve the relays below until the test is done
    served = {"grpc": relay.stats.served["bytes"], "stream": relay.stream_server.served_bytes if relay.stream_server else 0}
    (out / f"{args.name}.served.json").write_text(json.dumps(served))  # this relay's egress, per transport
    relay.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
