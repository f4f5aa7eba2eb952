"""The DeepMind Reverb side of ``buffer_vs_reverb.py``: a server, a writer and a reader.

Runs in Reverb's own virtual environment (never the project's), started by the benchmark with
``python -I`` so the repository's packages cannot shadow the standard library's::

    reverb-python -I benchmarks/reverb_peer.py server --port P --capacity 1024 --ready-file F
    reverb-python -I benchmarks/reverb_peer.py writer --port P --tokens 512 --per-call 1 ...
    reverb-python -I benchmarks/reverb_peer.py reader --port P --batch 32 ...

The table is a FIFO queue (each item sampled once, then gone), Reverb's equivalent of a buffer
whose batches are committed: writers block when it holds ``capacity`` items.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import threading
import time

import numpy as np

TABLE = "trajectories"


def trajectory(tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    mask = np.ones(tokens, np.uint8)
    mask[: tokens // 4] = 0
    return {
        "token_ids": rng.integers(0, 32000, tokens, dtype=np.int32),
        "loss_mask": mask,
        "logprobs": np.where(mask == 1, -0.5, 0.0).astype(np.float32),
        "policy_versions": np.where(mask == 1, 0, -1).astype(np.int32),
    }


def wait_for_go(args: argparse.Namespace) -> None:
    """Say this process is set up (imports take seconds here), then wait until every client is:
    the measured window starts for all at once."""
    with open(args.out + ".ready", "w"):
        pass
    while not os.path.exists(args.go):
        time.sleep(0.01)


def serve(args: argparse.Namespace) -> None:
    import reverb

    table = reverb.Table.queue(TABLE, max_size=args.capacity)
    server = reverb.Server(tables=[table], port=args.port or None)  # None: a free port
    with open(args.ready_file + ".tmp", "w") as f:
        f.write(str(server.port))
    os.replace(args.ready_file + ".tmp", args.ready_file)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop()


def write(args: argparse.Namespace) -> None:
    """Insert trajectories ``per_call`` at a time, at most ``window`` unconfirmed; a trajectory's
    latency is from its ``create_item`` until a ``flush`` shows it confirmed."""
    import reverb

    client = reverb.Client(f"localhost:{args.port}")
    rng = np.random.default_rng(os.getpid())
    steps = [trajectory(args.tokens, rng) for _ in range(16)]
    sent: collections.deque[float] = collections.deque()
    latencies: list[float] = []
    inserted = 0
    wait_for_go(args)
    start = time.monotonic()
    measure_from, stop_at = start + args.warmup, start + args.warmup + args.seconds
    cpu_start: float | None = None
    with client.trajectory_writer(num_keep_alive_refs=1) as writer:
        index = 0
        while (now := time.monotonic()) < stop_at:
            if cpu_start is None and now >= measure_from:
                cpu_start, inserted, latencies = time.process_time(), 0, []
            for _ in range(args.per_call):
                writer.append(steps[index % len(steps)])
                index += 1
                writer.create_item(TABLE, priority=1.0, trajectory={k: writer.history[k][-1] for k in steps[0]})
                sent.append(time.monotonic())
            writer.flush(block_until_num_items=max(0, args.window - args.per_call))
            now = time.monotonic()
            while len(sent) > max(0, args.window - args.per_call):
                latencies.append(now - sent.popleft())
                inserted += 1
        writer.flush()
    cpu = time.process_time() - (cpu_start or time.process_time())
    with open(args.out, "w") as f:
        json.dump({"inserted": inserted, "latencies": latencies, "cpu": cpu, "seconds": args.seconds}, f)


def read(args: argparse.Namespace) -> None:
    """Sample batches of ``batch`` items (each taken out of the queue); the figures of the
    measured window are written when it ends, then it keeps draining until stopped, so no writer
    is left blocked on a full table."""
    import reverb

    client = reverb.Client(f"localhost:{args.port}")
    wait_for_go(args)
    start = time.monotonic()
    measure_from = start + args.warmup
    measure_to = measure_from + args.seconds
    items = 0
    cpu_start: float | None = None
    reported = False
    while True:
        now = time.monotonic()
        if cpu_start is None and now >= measure_from:
            cpu_start, items = time.process_time(), 0
        if not reported and now >= measure_to:
            with open(args.out, "w") as f:
                json.dump({"items": items, "cpu": time.process_time() - (cpu_start or 0.0), "seconds": args.seconds}, f)
            reported = True
        for sample in client.sample(TABLE, num_samples=args.batch, emit_timesteps=False):
            _ = sample.data[0]  # numpy arrays, as the learner would take them
            items += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["server", "writer", "reader"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--ready-file", default="")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--per-call", type=int, default=1)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--out", default="")
    parser.add_argument("--go", default="")
    args = parser.parse_args()
    {"server": serve, "writer": write, "reader": read}[args.role](args)


if __name__ == "__main__":
    main()
