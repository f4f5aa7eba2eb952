"""What serving from several hosts costs: one rollout server as one process over two devices,
against the same server as two processes of one device each (rollout/hosts.py), side by side.

    .venv/bin/python benchmarks/rollout_multihost.py [--rounds 3] [--clients 8] [--seconds 15]

Both run the same model, tensor parallel over two CPU devices (tp=2), behind the real `stoker
rollout` command; only the process layout differs. The two-process server also announces every
sampler call to its other host (an all-gather and a broadcast) and runs its collectives over gloo
instead of in one process. Rounds alternate the layouts; each drives ``--clients`` concurrent
multi-turn clients (benchmarks/rollout_server.py's) for ``--seconds`` after a warm-up, and reads
the primary's tokens/s. Reports each round and the median ratio two-process / one-process.

    .venv/bin/python benchmarks/rollout_multihost.py --announce

times the announcement alone: two processes exchange a sampler call as the server does
(``stoker.distributed.share``: an all-gather of the digests, a broadcast of the call) for calls
of 8 prompts of 16 to 2,048 tokens, and report ms per call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollout_server import run_load

MANIFEST = """
apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {{name: multihost-bench}}
spec:
  model:
    architecture: {{vocabSize: {vocab}, hiddenSize: {hidden}, numLayers: {layers}, numHeads: 4, numKvHeads: 2, intermediateSize: {mlp}, maxSeqLen: 512}}
  environment: {{name: frozenlake}}
  actors: {{sampling: {{temperature: 1.0}}}}
  learner: {{sequenceBuckets: [512], compilationCacheDir: {cache}}}
  rollout: {{replicas: 1, maxBatch: {batch}, maxQueue: 256}}
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(layout: str, manifest: Path, ready: Path) -> list[subprocess.Popen[bytes]]:
    """``one``: a process with two devices; ``two``: two processes with one device each."""
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "stoker.cli", "rollout", "--manifest", str(manifest), "--host", "127.0.0.1",
            "--port", "0", "--mesh", "tp=2", "--log-level", "WARNING"]
    base = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if layout == "one":
        envs = [{**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}]
    else:
        shared = {**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "STOKER_NUM_PROCESSES": "2",
                  "STOKER_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}"}
        envs = [{**shared, "STOKER_PROCESS_ID": str(i)} for i in range(2)]
    return [
        subprocess.Popen([*argv, *(["--ready-file", str(ready)] if i == 0 else [])], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i, env in enumerate(envs)
    ]


def wait_ready(ready: Path, procs: list[subprocess.Popen[bytes]]) -> str:
    deadline = time.monotonic() + 600
    while not ready.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise SystemExit("a rollout server failed to start")
        time.sleep(0.2)
    return f"127.0.0.1:{int(ready.read_text())}"


def measure(layout: str, manifest: Path, ready: Path, args: argparse.Namespace) -> float:
    procs = start(layout, manifest, ready)
    try:
        address = wait_ready(ready, procs)
        asyncio.run(run_load(address, args.clients, args.warmup, args))  # compiles every program
        tokens, _, _, wall = asyncio.run(run_load(address, args.clients, args.seconds, args))
        return tokens / wall
    finally:
        for p in procs:
            p.kill()
            p.wait()


ANNOUNCE_TOKENS = (16, 256, 2048)


def announce_worker(reps: int) -> None:
    """One of the two processes of ``--announce`` (its topology in the environment)."""
    from stoker import distributed
    from stoker.rollout.hosts import GENERATE, encode_call

    distributed.initialize()
    processes = distributed.Processes.current()
    for tokens in ANNOUNCE_TOKENS:
        call = encode_call(GENERATE, [[7] * tokens] * 8, max_new_tokens=16, stop_token_ids=[], sessions=list("abcdefgh"),
                           temperature=None)
        distributed.share(processes, 1, call, doing="warming up")
        t0 = time.perf_counter()
        for _ in range(reps):
            distributed.share(processes, 1, call, doing="announcing")
        if processes.primary:
            print(f"| 8 x {tokens} | {len(call) / 1024:.0f} KiB | {1000 * (time.perf_counter() - t0) / reps:.2f} |")
            sys.stdout.flush()


def announce(reps: int) -> None:
    shared = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
              "STOKER_NUM_PROCESSES": "2", "STOKER_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}"}
    print("| prompts x tokens | call | ms per announcement |\n|---|---|---|")
    sys.stdout.flush()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--announce-worker", str(reps)], env={**shared, "STOKER_PROCESS_ID": str(i)},
                         stderr=subprocess.DEVNULL)
        for i in range(2)
    ]
    for p in procs:
        p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--announce", action="store_true", help="time the announcement of a sampler call alone")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--announce-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.announce_worker is not None:
        return announce_worker(args.announce_worker)
    if args.announce:
        return announce(args.reps)
    work = Path(tempfile.mkdtemp(prefix="rollout-multihost-"))
    manifest = work / "job.yaml"
    manifest.write_text(MANIFEST.format(
        vocab=args.vocab, hidden=args.hidden, layers=args.layers, mlp=4 * args.hidden, batch=args.max_batch,
        cache=work / "jax-cache",
    ))
    print(f"tp=2, hidden {args.hidden} x {args.layers} layers, batch {args.max_batch}, {args.clients} clients, "
          f"{args.new_tokens} tokens per turn")
    print("| round | one process, tokens/s | two processes, tokens/s | two / one |\n|---|---|---|---|")
    ratios = []
    for round_ in range(args.rounds):
        one = measure("one", manifest, work / "ready", args)
        two = measure("two", manifest, work / "ready", args)
        ratios.append(two / one)
        print(f"| {round_ + 1} | {one:.0f} | {two:.0f} | {two / one:.2f} |")
        sys.stdout.flush()
    print(f"\nmedian two / one: {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
