"""One actor's episode loop alone: episodes/s and CPU per model turn, as one JSON line.

    python benchmarks/actor_rate.py MANIFEST [--groups 40] [--swap-seconds 0.28] [--cpu-threads N]
        [--sequential] [--weight-sync between-episodes] [--switch-interval 0.001]

The manifest's policy (random weights), sampler batching and environments (use one whose
``environment.sandbox.kind`` is inline to leave sandboxes out), ``--groups`` groups to compile
every shape, then ``--groups`` more timed. ``--swap-seconds``: new weights that often, as a
running learner publishes them. ``--cpu-threads``: XLA's CPU pools sized to N threads as the
actor sizes them (``stoker.cpu_threads``; default: XLA's own, one per core). ``--sequential``: one
group at a time, as an actor whose concurrency is its group size plays them; a group's latency
(first episode's start to last one's end) is what sets an asynchronous step at ``maxStaleness: 1``.
Run several at once (``&``), or under ``taskset``, to see what actors sharing a host cost each
other (benchmarks/README.md, "The example's environments in the actor").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from stoker.actor.episode import run_group
from stoker.actor.sandbox import inline_factory
from stoker.actor.settings import ActorSettings
from stoker.actor.wiring import make_policy
from stoker.conversation.tokenization import text_interface
from stoker.manifest import load_job
from stoker.model.model import init_model
from stoker.trajectory import Episode
from stoker.weights.channel import flatten_params


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--swap-seconds", type=float, default=0.0, help="load new weights this often (0: never)")
    parser.add_argument("--cpu-threads", type=int, default=None, help="XLA's CPU pools (default: one thread per core)")
    parser.add_argument("--sequential", action="store_true", help="one group at a time (concurrency = group size)")
    parser.add_argument("--weight-sync", choices=["between-turns", "between-episodes"], default=None)
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (Python's: 0.005 s)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    spec = load_job(args.manifest).spec
    settings = ActorSettings.from_spec(spec, actor_id="rate", job="rate")
    if args.weight_sync is not None:
        settings = dataclasses.replace(settings, weight_sync=args.weight_sync)
    policy = make_policy(settings, cpu_threads=args.cpu_threads)
    interface = text_interface(spec)
    factory = inline_factory(settings.sandbox)

    latencies: list[tuple[float, int]] = []  # a group's seconds, its longest episode's turns

    async def timed(g: int, seed: int, slots: asyncio.Semaphore) -> list[Episode]:
        group = await run_group(policy, factory, interface, settings.tasks[g % len(settings.tasks)], settings.group_size,
                                limits=settings.limits, seed=seed + g, slots=slots)
        seconds = max(e.finished_unix for e in group) - min(e.started_unix for e in group)
        latencies.append((seconds, max(e.num_turns for e in group)))
        return group

    async def groups(n: int, seed: int) -> list[Episode]:
        slots = asyncio.Semaphore(settings.group_size if args.sequential else settings.concurrency)
        if args.sequential:
            return [e for g in range(n) for e in await timed(g, seed, slots)]
        return [e for group in await asyncio.gather(*(timed(g, seed, slots) for g in range(n))) for e in group]

    async def swap(every: float) -> None:
        flat = flatten_params(init_model(settings.model, seed=1))
        version = 1
        while True:
            await asyncio.sleep(every)  # the publishing period being imitated
            version += 1
            await policy.load_weights(flat, version)

    swapper = asyncio.create_task(swap(args.swap_seconds)) if args.swap_seconds > 0 else None
    started = time.perf_counter()
    policy.warm_up(settings.concurrency)  # as an actor does before its first episode
    await groups(args.groups, 0)  # every other shape (under swaps too, when they run)
    warm = time.perf_counter() - started
    latencies.clear()
    started, cpu = time.perf_counter(), time.process_time()
    calls, requests = policy.stats.calls, policy.stats.requests
    episodes = await groups(args.groups, 1000)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    if swapper is not None:
        swapper.cancel()
    turns = sum(e.num_turns for e in episodes)
    print(json.dumps({
        "pid": os.getpid(), "warm_s": round(warm, 2), "episodes_per_s": round(len(episodes) / wall, 1),
        "cpu_ms_per_turn": round(cpu / turns * 1e3, 2), "cores": round(cpu / wall, 2),
        "rows_per_call": round((policy.stats.requests - requests) / max(policy.stats.calls - calls, 1), 1),
        "threads": len(os.listdir("/proc/self/task")), "cpu_threads": args.cpu_threads,
        "group_ms_median": round(statistics.median(s for s, _ in latencies) * 1e3, 1),
        "group_ms_p90": round(statistics.quantiles([s for s, _ in latencies], n=10)[-1] * 1e3, 1),
        "group_ms_per_turn": round(sum(s for s, _ in latencies) / sum(t for _, t in latencies) * 1e3, 2),
        "sequential": args.sequential, "weight_sync": settings.weight_sync, "switch_interval": sys.getswitchinterval(),
    }), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
