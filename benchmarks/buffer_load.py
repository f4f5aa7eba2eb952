"""The load ``buffer_throughput.py`` puts on a server: writer processes and one reader, using the
real client library, and the server's CPU time and context switches read from /proc."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoker.procstat import proc_stat

TRAJECTORY_BYTES_PER_TOKEN = 4 + 1 + 4 + 4  # ids, mask, log-probs, versions
READY_TIMEOUT = 60.0
DRAIN_SECONDS = 2.0  # the reader keeps draining this long after a round so no writer is stuck


def trajectory_body(tokens: int, seed: int) -> bytes:
    """The per-token arrays (and fixed fields) of a synthetic episode, serialized once."""
    from stoker.buffer.wire import encode_trajectory
    from stoker.trajectory import Episode

    rng = np.random.default_rng(seed)
    mask = np.ones(tokens, np.uint8)
    mask[: min(16, tokens - 1)] = 0  # a prompt the model did not sample
    episode = Episode(
        episode_id="",
        group_id="",
        group_size=0,
        task_id="bench",
        token_ids=rng.integers(0, 50_000, tokens, dtype=np.int32),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -rng.random(tokens, dtype=np.float32), 0).astype(np.float32),
        policy_versions=np.where(mask == 1, 0, -1).astype(np.int32),
        reward=1.0,
        num_turns=1,
    )
    return encode_trajectory(episode)


def worker_main(role: str, index: int, tokens: int, args: argparse.Namespace, barrier: Any, commands: Any, results: Any) -> None:
    """A writer or the reader, alive for all rounds of one size; each command is one round
    ``(address, tag, seconds)`` against one server, started on the shared barrier."""
    from stoker.buffer.client import BufferClient, BufferUnavailableError, RetryPolicy
    from stoker.v1 import trajectory_pb2

    body = trajectory_body(tokens, index)
    clients: dict[str, BufferClient] = {}
    while (command := commands.get()) is not None:
        address, tag, seconds = command
        if address not in clients:
            clients[address] = BufferClient(
                address,
                client_id=f"writer-{index}",
                learner_id="bench-reader",
                retry=RetryPolicy(initial=0.002, maximum=0.05, deadline=seconds + DRAIN_SECONDS),
            )
            clients[address].wait_ready(READY_TIMEOUT)
        client = clients[address]
        count = [0]
        latencies: list[float] = []
        lock = threading.Lock()
        cpu_before = time.process_time()
        barrier.wait(timeout=READY_TIMEOUT)
        end = time.monotonic() + seconds

        def write(lane: int) -> None:
            sequence = 0
            while time.monotonic() < end:
                group = f"{tag}w{index}l{lane}g{sequence}"
                items = [
                    trajectory_pb2.Trajectory(
                        episode_id=f"{group}e{k}", group_id=group, group_size=args.batch, actor_id=f"writer-{index}"
                    ).SerializeToString()
                    + body
                    for k in range(args.batch)
                ]
                began = time.perf_counter()
                try:
                    summary, rejected = client.put_encoded(items)
                except BufferUnavailableError:
                    if time.monotonic() < end:
                        raise
                    return
                elapsed = time.perf_counter() - began
                if rejected:
                    raise RuntimeError(f"benchmark trajectory rejected: {rejected[0]}")
                if time.monotonic() > end:
                    return  # finished after the measured window: not counted
                with lock:
                    latencies.append(elapsed)
                    count[0] += summary.stored
                sequence += 1

        def read() -> None:
            # Like a learner: take a batch, use it, commit it in the background while fetching the next.
            # It drains a little past the window so no writer is left waiting; only what arrived
            # inside the window counts.
            commits = []
            while time.monotonic() < end + DRAIN_SECONDS:
                batch = client.sample(args.sample_groups, args.sample_groups, timeout=0.1)
                if batch is None:
                    continue
                received = sum(int(e.num_tokens == tokens) for e in batch.episodes)  # decoded numpy views
                commits.append(client.commit_async(batch.batch_id))
                if time.monotonic() <= end:
                    count[0] += received
                    latencies.append(len(batch.groups))  # the reader reports groups per Sample
            for commit in commits:
                commit.result()

        if role == "reader":
            read()
        else:
            lanes = [threading.Thread(target=write, args=(lane,)) for lane in range(args.window)]
            for lane in lanes:
                lane.start()
            for lane in lanes:
                lane.join()
        results.put((role, count[0], latencies, time.process_time() - cpu_before))
    for client in clients.values():
        client.close()


@dataclass
class Round:
    stored: int
    read: int
    seconds: float
    server_cpu: float
    server_system_cpu: float  # kernel time: socket I/O, log writes and flushes
    server_switches: int  # context switches of all the server's threads
    clients_cpu: float
    latencies: list[float]
    groups_per_sample: list[float]


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of every thread of a process, from /proc."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            lines = (task / "status").read_text().splitlines()
        except OSError:  # the thread ended meanwhile
            continue
        total += sum(int(line.split()[1]) for line in lines if "ctxt_switches:" in line)
    return total


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, from /proc."""
    fields = proc_stat(pid)
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class Workers:
    """The writer processes and the reader, reused for every round of one size."""

    def __init__(self, tokens: int, args: argparse.Namespace):
        ctx = mp.get_context("spawn")
        roles = ["writer"] * args.writers + ["reader"]
        self.barrier = ctx.Barrier(len(roles) + 1)
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in roles]
        self.processes = [
            ctx.Process(target=worker_main, args=(role, i, tokens, args, self.barrier, queue, self.results), daemon=True)
            for i, (role, queue) in enumerate(zip(roles, self.commands, strict=True))
        ]
        for process in self.processes:
            process.start()

    def run_round(self, address: str, pid: int, tag: str, seconds: float) -> Round:
        """One measured stretch against one running server (pid: for its CPU time)."""
        for queue in self.commands:
            queue.put((address, tag, seconds))
        self.barrier.wait(timeout=READY_TIMEOUT)  # every worker connected: the clock starts
        user_before, system_before = cpu_seconds(pid)
        switches_before = context_switches(pid)
        collected = [self.results.get(timeout=seconds + 120) for _ in self.processes]
        elapsed = seconds  # each worker counts only what completed inside its window
        user, system = cpu_seconds(pid)
        switches = context_switches(pid) - switches_before
        return Round(
            stored=sum(n for role, n, _, _ in collected if role == "writer"),
            read=sum(n for role, n, _, _ in collected if role == "reader"),
            seconds=elapsed,
            server_cpu=user - user_before + system - system_before,
            server_system_cpu=system - system_before,
            server_switches=switches,
            clients_cpu=sum(cpu for _, _, _, cpu in collected),
            latencies=[x for role, _, lat, _ in collected if role == "writer" for x in lat],
            groups_per_sample=[x for role, _, lat, _ in collected if role == "reader" for x in lat],
        )

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
