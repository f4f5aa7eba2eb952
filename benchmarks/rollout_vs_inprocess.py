"""N actors calling one rollout server against the same N actors each sampling in-process.

    .venv/bin/python benchmarks/rollout_vs_inprocess.py [--actors 2] [--concurrency 8] [--latency 0.05]
                     [--hidden 256] [--layers 4] [--rounds 3] [--seconds 20] [--warmup 60] [--cpus 0,1]

The job is examples/frozenlake-rollout.yaml with a bigger policy (``--hidden`` x ``--layers``, so
sampling dominates an actor's work), inline FrozenLake environments and a fixed step latency of
``--latency`` s. Every actor is its own process running the actor's real episode code
(``run_group`` over ``ActorSettings.from_spec``, ``environment_factory`` and the policy
``build_and_run`` would give it): ``RemotePolicy`` for the server arm, ``make_policy`` (its own
JAX sampler) for the in-process arm. The server arm adds one rollout-server process
(``make_engine`` + ``RolloutServer``, as ``stoker rollout`` builds them).

Same total CPU: this process pins itself to ``--cpus`` (``os.sched_setaffinity``) before starting
any child, so the server and every actor of both arms inherit the same cores. Both arms' actor
processes live for the whole run (programs compile once, in the warm-up); only one arm runs at a
time, the other's processes block on their pipe. Rounds alternate which arm goes first.

CPU is read with ``time.process_time()`` inside each process (every thread of it: the event loop,
the sampler thread, gRPC's threads), before and after each measured interval. Reports per arm the
medians over rounds and, for the ratios (server / in-process), the median and the range.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import yaml

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "frozenlake-rollout.yaml"


class Interval(NamedTuple):
    episodes: int
    cpu_seconds: float
    wall_seconds: float


def make_job(args: argparse.Namespace) -> Any:
    from stoker.spec import RLJob

    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["model"]["architecture"] = {
        "vocabSize": 27, "hiddenSize": args.hidden, "numLayers": args.layers, "numHeads": max(1, args.hidden // 64),
        "numKvHeads": max(1, args.hidden // 128), "intermediateSize": 4 * args.hidden,
    }  # fmt: skip
    spec["environment"]["stepLatency"] = {"distribution": "fixed", "seconds": args.latency}
    spec["environment"]["sandbox"] = {"kind": "inline"}
    spec["actors"]["concurrency"] = args.concurrency
    spec["rollout"]["maxBatch"] = args.max_batch
    spec["learner"]["compilationCacheDir"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "rollout-vs-inprocess-jax")
    return RLJob.model_validate(doc)


def serve(args: argparse.Namespace, conn: Connection) -> None:
    """The rollout-server process: answers ``cpu`` with its process time until ``stop``."""
    from stoker.rollout.server import RolloutServer
    from stoker.rollout.settings import RolloutSettings, make_engine

    settings = RolloutSettings.from_spec(make_job(args).spec, port=0)
    server = RolloutServer(make_engine(settings)).start()
    conn.send(server.port)
    while (command := conn.recv()) != "stop":
        assert command == "cpu"
        conn.send(time.process_time())
    server.stop(grace=0)


def act(args: argparse.Namespace, actor_id: str, address: str | None, conn: Connection) -> None:
    """One actor process: on ``(run, seconds)``, plays groups for that long and answers an Interval."""
    asyncio.run(_act(args, actor_id, address, conn))


async def _act(args: argparse.Namespace, actor_id: str, address: str | None, conn: Connection) -> None:
    from stoker.actor.episode import run_group
    from stoker.actor.settings import ActorSettings
    from stoker.conversation.tokenization import text_interface
    from stoker.actor.wiring import environment_factory, make_policy
    from stoker.rollout.client import RemotePolicy

    job = make_job(args)
    settings = ActorSettings.from_spec(job.spec, actor_id=actor_id, rollout_address=address)
    policy: Any = (
        RemotePolicy(address, actor_id=actor_id, pin_weights=settings.weight_sync == "between-episodes")
        if address else await asyncio.to_thread(make_policy, settings, job.spec.model.dtype)
    )
    factory, interface = environment_factory(settings), text_interface(job.spec)
    slots, tasks = asyncio.Semaphore(settings.concurrency), settings.tasks
    conn.send("ready")
    seed = 0
    while (command := await asyncio.to_thread(conn.recv)) != "stop":
        _, seconds = command
        stop_at = time.perf_counter() + seconds
        episodes = failed = 0

        async def groups() -> None:  # one of two loops, so the slots stay full across a group's tail
            nonlocal episodes, failed, seed
            while time.perf_counter() < stop_at:
                seed += 1
                group = await run_group(policy, factory, interface, tasks[seed % len(tasks)], settings.group_size, limits=settings.limits,
                                        seed=seed, actor_id=actor_id, slots=slots)  # fmt: skip
                episodes += len(group)
                failed += sum(not e.ok for e in group)

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(groups(), groups())
        interval = Interval(episodes, time.process_time() - cpu0, time.perf_counter() - t0)
        conn.send(interval if not failed else f"{failed} of {episodes} episodes failed")
    await policy.close()


def run_arm(conns: list[Connection], seconds: float, server: Connection | None) -> tuple[Interval, float]:
    """All of an arm's actors at once; returns their sum (wall: the slowest) and the server's CPU."""
    server_cpu = 0.0
    if server is not None:
        server.send("cpu")
        server_cpu = -server.recv()
    for c in conns:
        c.send(("run", seconds))
    results = [c.recv() for c in conns]
    if server is not None:
        server.send("cpu")
        server_cpu += server.recv()
    problems = [r for r in results if isinstance(r, str)]
    if problems:  # a rate of failures would measure nothing
        raise SystemExit(f"episodes failed: {problems[0]}")
    total = Interval(sum(r.episodes for r in results), sum(r.cpu_seconds for r in results),
                     max(r.wall_seconds for r in results))  # fmt: skip
    return total, server_cpu


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent episodes per actor")
    parser.add_argument("--latency", type=float, default=0.05, help="fixed environment step latency (s)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=16, help="the rollout server's maxBatch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="per arm per round")
    parser.add_argument("--warmup", type=float, default=60.0, help="per arm, before the rounds (compiles)")
    parser.add_argument("--cpus", default=None, help="cores for every process, e.g. 0,1 (default: this process's)")
    args = parser.parse_args(argv)
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # inherited by every child: both arms get the same cores
    make_job(args)  # a bad flag fails here, before any process starts
    ctx = mp.get_context("spawn")
    children: list[Any] = []

    def start(target: Any, *extra: Any) -> Connection:
        parent, child = ctx.Pipe()
        process = ctx.Process(target=target, args=(args, *extra, child), daemon=True)
        process.start()
        children.append((process, parent))
        return parent

    server = start(serve)
    address = f"127.0.0.1:{server.recv()}"
    remote = [start(act, f"remote-{i}", address) for i in range(args.actors)]
    local = [start(act, f"local-{i}", None) for i in range(args.actors)]
    for c in remote + local:
        assert c.recv() == "ready"
    print(f"{args.actors} actors x {args.concurrency} episodes, step latency {args.latency:g} s, "
          f"{args.hidden}x{args.layers} policy, cores {sorted(cpus)}; warming up {args.warmup:g} s per arm")  # fmt: skip
    sys.stdout.flush()
    run_arm(remote, args.warmup, server)
    run_arm(local, args.warmup, None)
    rows: dict[str, list[tuple[Interval, float]]] = {"server": [], "in-process": []}
    for r in range(args.rounds):  # interleaved, alternating which goes first: the machine is shared
        order = [("server", remote, server), ("in-process", local, None)]
        for name, conns, srv in order if r % 2 == 0 else order[::-1]:
            interval, server_cpu = run_arm(conns, args.seconds, srv)
            rows[name].append((interval, server_cpu))
            print(f"round {r + 1} {name}: {interval.episodes} episodes in {interval.wall_seconds:.1f} s, "
                  f"actor CPU {interval.cpu_seconds:.1f} s, server CPU {server_cpu:.1f} s")  # fmt: skip
            sys.stdout.flush()
    for process, conn in children:
        conn.send("stop")
    for process, _ in children:
        process.join(timeout=30)

    def metrics(interval: Interval, server_cpu: float) -> dict[str, float]:
        n = interval.episodes
        return {"episodes/s": n / interval.wall_seconds, "actor CPU ms/episode": 1e3 * interval.cpu_seconds / n,
                "server CPU ms/episode": 1e3 * server_cpu / n,
                "total CPU ms/episode": 1e3 * (interval.cpu_seconds + server_cpu) / n}  # fmt: skip

    per_round = {name: [metrics(*x) for x in runs] for name, runs in rows.items()}
    print(f"\nmedians of {args.rounds} interleaved rounds of {args.seconds:g} s; ratio: median (range) over rounds")
    print("| metric | server arm | in-process arm | server / in-process |\n|---|---|---|---|")
    for key in per_round["server"][0]:
        s = [m[key] for m in per_round["server"]]
        p = [m[key] for m in per_round["in-process"]]
        ratio = spread([a / b for a, b in zip(s, p)]) if all(p) else "-"
        print(f"| {key} | {statistics.median(s):.1f} | {statistics.median(p):.1f} | {ratio} |")


if __name__ == "__main__":
    main()
