"""How many cores this host really runs at once: the aggregate rate of 1, 2, 4, ... busy processes
against one, beside what the affinity mask, ``nproc`` and the cgroup's CPU quota say.

    python3 benchmarks/host_cpu.py [--seconds 2] [--json OUT.json]

A host whose mask shows 13 cores under a CPU quota of 4 scales to ~4x and no further; actors
sized by the mask then share 4 cores and look latency-bound (CFS throttling), not CPU-bound.
``stoker.actor_count.host_cores`` reads the quota; this measures what the scheduler gives.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

from stoker.actor_count import cpu_quota_cores, host_cores


def spin(seconds: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Count loop iterations for ``seconds`` of wall time: one core's work rate."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10_000):
            count += 1
    out.put(count)


def rate(processes: int, seconds: float) -> float:
    """Iterations per second of ``processes`` busy processes together."""
    queue: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    workers = [multiprocessing.Process(target=spin, args=(seconds, queue)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    total = sum(queue.get() for _ in workers)
    for worker in workers:
        worker.join()
    return total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="wall time per count of processes")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    mask = len(os.sched_getaffinity(0))
    counts = sorted({1, 2, 4, mask // 2, mask} - {0})
    one = rate(1, args.seconds)
    rows = [{"processes": n, "speedup": 1.0 if n == 1 else rate(n, args.seconds) / one} for n in counts]
    quota = cpu_quota_cores()
    report = {"affinity_cores": mask, "cpu_count": os.cpu_count(), "cgroup_quota_cores": quota,
              "host_cores": host_cores(), "scaling": rows}
    print(f"affinity mask {mask} cores, os.cpu_count {os.cpu_count()}, cgroup quota "
          f"{'none' if quota is None else f'{quota:g} cores'}, stoker's host_cores {host_cores()}")
    print("| busy processes | aggregate rate against one |\n|---|---|")
    for row in rows:
        print(f"| {row['processes']} | {row['speedup']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
