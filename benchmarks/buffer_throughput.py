"""Buffer throughput against a plain gRPC echo server (the transport ceiling), in one run.

    .venv/bin/python benchmarks/buffer_throughput.py                 # 20 s per case, 512 and 32768 tokens
    .venv/bin/python benchmarks/buffer_throughput.py --seconds 2 --sizes 64 --json out.json

For each trajectory size, the same load runs against each target in turn: W writer processes (each with ``--window``
Puts in flight, one group of ``--batch`` trajectories per Put) and one reader process
(Sample up to ``--sample-groups`` groups, decode, Commit) against

* ``echo``: a gRPC server speaking the same Buffer protocol that keeps the request bytes in a
  bounded queue and hands them to the reader as they are: no validation, no log, no groups;
* ``echo-log``: the same echo server that also appends each Put's bytes to a file and flushes
  (``fdatasync``, shared by concurrent Puts) before answering -- what durability alone costs;
* ``buffer``: ``stoker buffer`` with durability on (fsync per Put batch and per Commit).

Both servers run as their own process; their CPU time per trajectory comes from /proc. Writers and
the reader use the real client library (``BufferClient``), so backoff on a full server is the same.
Reported per case: trajectories/s and MB/s written, p50/p99 Put latency, reader trajectories/s,
server CPU microseconds per trajectory, and the buffer/echo and echo-log/echo throughput ratios.
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

TRAJECTORY_BYTES_PER_TOKEN = 4 + 1 + 4 + 4  # ids, mask, log-probs, versions
READY_TIMEOUT = 60.0
DRAIN_SECONDS = 2.0  # the reader keeps draining this long after a round so no writer is stuck


# ----------------------------------------------------------------------------- echo server


class DurableLog:
    """The least a durable server must do per Put: append its bytes to a file and flush before
    answering, with concurrent Puts sharing one ``fdatasync`` (group commit). Files of
    ``SEGMENT_BYTES``, preallocated as the buffer's log is, replace each other when full."""

    SEGMENT_BYTES = 256 << 20

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.write_lock = threading.Lock()
        self.sync_lock = threading.Lock()
        self.segment = 0
        self.fd = self._open(0)
        self.offset = 0
        self.written = 0  # bytes appended in all, over every segment
        self.synced = 0  # ...of which flushed
        self.retired: list[int] = []  # full files' descriptors, closed by the next flush (one may be flushing them)

    def _open(self, number: int) -> int:
        fd = os.open(self.directory / f"{number:06d}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(fd, 0, self.SEGMENT_BYTES)
        return fd

    def append(self, data: bytes) -> None:
        with self.write_lock:
            if self.offset + len(data) > self.SEGMENT_BYTES:
                os.fdatasync(self.fd)  # what the old file holds is durable before it is dropped
                self.retired.append(self.fd)
                (self.directory / f"{self.segment:06d}.log").unlink()
                self.segment += 1
                self.fd, self.offset = self._open(self.segment), 0
            os.pwrite(self.fd, data, self.offset)
            self.offset += len(data)
            self.written += len(data)
            mine = self.written
        with self.sync_lock:
            if self.synced >= mine:
                return  # another Put's flush covered this one
            with self.write_lock:
                fd, upto = self.fd, self.written
                retired, self.retired = self.retired, []
            os.fdatasync(fd)
            self.synced = upto
            for old in retired:
                os.close(old)


def run_echo_server(ready_file: Path, capacity: int, max_message_bytes: int, log_dir: Path | None = None) -> None:
    """The transport ceiling: Put bytes in, Sample bytes out, nothing else -- or, with ``log_dir``,
    only that and a durable append of each Put (``echo-log``)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from stoker.endpoints import write_ready_file
    from stoker.buffer.wire import encode_varint, split_put_request
    from stoker.v1 import buffer_pb2

    log = DurableLog(log_dir) if log_dir is not None else None
    cond = threading.Condition()
    queue: collections.deque[tuple[bytes, int]] = collections.deque()  # (PutRequest bytes, trajectories)
    held = [0]
    replies: dict[int, bytes] = {}

    def put(data: bytes, context: grpc.ServicerContext) -> bytes:
        # Walking the framing counts the trajectories, so the reply can say how many were taken.
        count = len(split_put_request(data)[1])
        if log is not None:
            log.append(data)
        with cond:
            # Full: wait a little rather than refuse at once, so few transfers are wasted.
            deadline = time.monotonic() + 0.2
            while held[0] + count > capacity and held[0] > 0:
                if not cond.wait(max(0.0, deadline - time.monotonic())):
                    context.set_trailing_metadata((("stoker-retry-after-ms", "10"),))
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "echo queue full")
            queue.append((data, count))
            held[0] += count
            cond.notify_all()
        if count not in replies:
            replies[count] = buffer_pb2.PutResponse(results=[buffer_pb2.PutResult()] * count, stored=count).SerializeToString()
        return replies[count]

    def sample(request: buffer_pb2.SampleRequest, context: grpc.ServicerContext) -> bytes:
        deadline = time.monotonic() + request.timeout_seconds
        with cond:
            while len(queue) < max(1, request.min_groups):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return b""
                cond.wait(remaining)
            taken = [queue.popleft() for _ in range(min(request.max_groups, len(queue)))]
            held[0] -= sum(count for _, count in taken)
            cond.notify_all()
        # A PutRequest {1: client_id, 2: trajectories} parses as a Group {1: group_id, 2: trajectories}.
        chunks = [b"\x0a\x04echo"]  # batch_id
        for blob, _ in taken:
            chunks += [b"\x12" + encode_varint(len(blob)), blob]
        return b"".join(chunks)

    def commit(request: buffer_pb2.CommitRequest, context: grpc.ServicerContext) -> buffer_pb2.CommitResponse:
        return buffer_pb2.CommitResponse()

    def identity(data: bytes) -> bytes:
        return data

    handler = grpc.method_handlers_generic_handler(
        "stoker.v1.Buffer",
        {
            "Put": grpc.unary_unary_rpc_method_handler(put, request_deserializer=identity, response_serializer=identity),
            "Sample": grpc.unary_unary_rpc_method_handler(
                sample, request_deserializer=buffer_pb2.SampleRequest.FromString, response_serializer=identity
            ),
            "Commit": grpc.unary_unary_rpc_method_handler(
                commit,
                request_deserializer=buffer_pb2.CommitRequest.FromString,
                response_serializer=buffer_pb2.CommitResponse.SerializeToString,
            ),
        },
    )
    options = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), handlers=[handler], options=options)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    health_servicer.set("stoker.v1.Buffer", health_pb2.HealthCheckResponse.SERVING)
    write_ready_file(ready_file, port)
    server.wait_for_termination()


# ----------------------------------------------------------------------------- load


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


# ----------------------------------------------------------------------------- orchestration


@dataclass
class CaseResult:
    target: str
    tokens: int
    seconds: float
    put_trajectories_per_s: float
    put_mb_per_s: float
    put_p50_ms: float
    put_p99_ms: float
    read_trajectories_per_s: float
    server_cpu_us_per_trajectory: float
    server_system_cpu_us_per_trajectory: float
    server_switches_per_trajectory: float  # context switches (thread handoffs, blocking calls)
    clients_cpu_us_per_trajectory: float  # writers + reader (the same code for both targets)
    groups_per_sample: float
    stored: int
    read: int
    full_rejections: int  # Puts the buffer refused as full (each one a wasted transfer); 0 for echo


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
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def wait_ready_file(path: Path, process: subprocess.Popen[bytes], timeout: float) -> str:
    """What the server wrote to its ready file: the bound port, or its unix:// address."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        time.sleep(0.02)
    raise RuntimeError(f"server not ready after {timeout}s")


def capacity_for(tokens: int, args: argparse.Namespace) -> int:
    """Trajectories either server holds: ``--capacity``, but at most ``--capacity-mb`` of data, so a
    round's start (an empty server absorbing a burst) does not dominate a short round."""
    by_bytes = int(args.capacity_mb * 1e6 / (tokens * TRAJECTORY_BYTES_PER_TOKEN))
    return max(2 * args.batch * args.writers * args.window, min(args.capacity, by_bytes))


def disk_baseline(directory: Path, batch_bytes: int, seconds: float) -> dict[str, float]:
    """What the log's disk gives one writer: append one Put's worth, fdatasync, repeat -- the way the
    log writes that size (through the page cache, or copied to an aligned buffer and written with
    O_DIRECT from ``DIRECT_MIN`` up)."""
    from stoker.buffer.wal_direct import DIRECT_MIN
    from stoker.buffer.wal_format import ALIGN

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "disk-baseline"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    direct = batch_bytes >= DIRECT_MIN
    stride = -(-batch_bytes // ALIGN) * ALIGN if direct else batch_bytes
    write_fd = os.open(path, os.O_WRONLY | os.O_DIRECT) if direct else fd
    staging = mmap.mmap(-1, stride)
    payload = os.urandom(batch_bytes)
    latencies: list[float] = []
    offset = 0
    try:
        os.posix_fallocate(fd, 0, 1 << 30)
        end = time.monotonic() + seconds
        cpu_before = time.thread_time()  # user + kernel time of this thread: the write and the flush
        while time.monotonic() < end and offset + stride < 1 << 30:
            began = time.perf_counter()  # a direct write waits for the device itself: time both parts
            if direct:
                staging[:batch_bytes] = payload
                os.pwrite(write_fd, staging, offset)
            else:
                os.pwrite(fd, payload, offset)
            offset += stride
            os.fdatasync(fd)
            latencies.append(time.perf_counter() - began)
        cpu = time.thread_time() - cpu_before
    finally:
        if direct:
            os.close(write_fd)
        os.close(fd)
        staging.close()
        path.unlink()
    total = sum(latencies) or 1e-9
    return {
        "append_p50_ms": float(np.percentile(latencies, 50) * 1e3),  # write + fdatasync
        "append_p99_ms": float(np.percentile(latencies, 99) * 1e3),
        "durable_mb_per_s": offset / 1e6 / total,
        "cpu_us_per_append": cpu / max(len(latencies), 1) * 1e6,
        "direct": float(direct),
    }


def logic_baseline(directory: Path, tokens: int, args: argparse.Namespace, seconds: float) -> float:
    """CPU microseconds per trajectory of the buffer's own work, in this one thread with no gRPC and
    no flush: split each Put request, validate, admit, append to the log (as the server writes it,
    direct from ``DIRECT_MIN`` up), store, then Sample, encode the response and Commit every
    ``--sample-groups`` Puts -- the floor under what the buffer server spends beyond the echo,
    whatever its threads or transport."""
    from unittest import mock

    import stoker.buffer.wal as wal_module
    from stoker.buffer.core import BufferCore
    from stoker.buffer.settings import BufferSettings
    from stoker.buffer.wire import encode_put_request, encode_sample_response, split_put_request
    from stoker.v1 import trajectory_pb2

    body = trajectory_body(tokens, 0)
    # The server's durable settings (so large appends go direct), minus the flush itself, which the
    # "disk" line measures.
    settings = BufferSettings(capacity=1 << 20, group_size=args.batch, max_staleness=1000, sync="batch")
    core = BufferCore(settings, directory)
    core.open()
    stored = 0
    try:
        with mock.patch.object(wal_module.os, "fdatasync", lambda fd: None):
            end = time.monotonic() + seconds
            cpu = 0.0
            while time.monotonic() < end:
                requests = []
                for index in range(args.sample_groups):  # encoded outside the measured CPU, as a client would
                    group = f"g{stored + index * args.batch}"
                    items = [
                        trajectory_pb2.Trajectory(episode_id=f"{group}e{k}", group_id=group, group_size=args.batch).SerializeToString() + body
                        for k in range(args.batch)
                    ]
                    requests.append(encode_put_request("logic", items))
                began = time.thread_time()
                for request in requests:
                    client_id, raws = split_put_request(request)
                    stored += core.put(raws, client_id).stored
                batch = core.sample(args.sample_groups, 1, 0)
                assert batch is not None
                encode_sample_response(batch.batch_id, batch.groups, batch.policy_version)
                core.commit(batch.batch_id)
                cpu += time.thread_time() - began
    finally:
        core.close()
    return cpu / max(stored, 1) * 1e6


def ceiling(echo: CaseResult, extra_cpu_us_per_trajectory: float) -> float:
    """The buffer/echo ratio a server would reach if ``extra`` were all it spent beyond the echo.
    Throughput here follows total CPU per trajectory (servers and clients share the cores), so this
    is what that cost alone leaves of the echo's throughput."""
    echo_total = echo.server_cpu_us_per_trajectory + echo.clients_cpu_us_per_trajectory
    return echo_total / (echo_total + extra_cpu_us_per_trajectory)


def start_server(target: str, work: Path, tokens: int, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    ready = work / f"{target}-{tokens}.ready"
    capacity = capacity_for(tokens, args)
    if target.startswith("echo"):
        command = [sys.executable, __file__, "--echo-server", str(ready), "--capacity", str(capacity)]
        if target == "echo-log":
            command += ["--echo-log", str(work / f"echo-log-{tokens}")]
    else:
        manifest = work / "job.yaml"
        manifest.write_text(
            json.dumps(
                {
                    "apiVersion": "stoker.dev/v1alpha1",
                    "kind": "RLJob",
                    "metadata": {"name": "bench"},
                    "spec": {
                        "buffer": {
                            "capacity": capacity,
                            "groupSize": args.batch,
                            "maxStaleness": 1000,
                            "sync": args.sync,
                        }
                    },
                }
            )
        )
        data = work / f"data-{tokens}"
        command = [
            sys.executable, "-m", "stoker.cli", "buffer", "--host", "127.0.0.1", "--port", "0",
            "--data-dir", str(data), "--manifest", str(manifest), "--ready-file", str(ready), "--log-level", "warning",
        ]  # fmt: skip
    process = subprocess.Popen(command)
    port = int(wait_ready_file(ready, process, READY_TIMEOUT))
    return process, f"127.0.0.1:{port}"


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


def summarize(target: str, tokens: int, rounds: list[Round], full_rejections: int = 0) -> CaseResult:
    stored = sum(r.stored for r in rounds)
    read = sum(r.read for r in rounds)
    elapsed = sum(r.seconds for r in rounds)
    latencies = np.array([x for r in rounds for x in r.latencies] or [float("nan")])
    mb = tokens * TRAJECTORY_BYTES_PER_TOKEN / 1e6
    return CaseResult(
        target=target,
        tokens=tokens,
        seconds=round(elapsed, 2),
        put_trajectories_per_s=stored / elapsed,
        put_mb_per_s=stored * mb / elapsed,
        put_p50_ms=float(np.percentile(latencies, 50) * 1e3),
        put_p99_ms=float(np.percentile(latencies, 99) * 1e3),
        read_trajectories_per_s=read / elapsed,
        server_cpu_us_per_trajectory=sum(r.server_cpu for r in rounds) / max(stored, 1) * 1e6,
        server_system_cpu_us_per_trajectory=sum(r.server_system_cpu for r in rounds) / max(stored, 1) * 1e6,
        server_switches_per_trajectory=sum(r.server_switches for r in rounds) / max(stored, 1),
        clients_cpu_us_per_trajectory=sum(r.clients_cpu for r in rounds) / max(stored, 1) * 1e6,
        groups_per_sample=float(np.mean([x for r in rounds for x in r.groups_per_sample] or [0.0])),
        stored=stored,
        read=read,
        full_rejections=full_rejections,
    )


def run_size(tokens: int, args: argparse.Namespace, work: Path) -> list[CaseResult]:
    """Both targets at one trajectory size, in alternating rounds so drifting background load on
    the machine hits them alike."""
    servers = {target: start_server(target, work, tokens, args) for target in args.targets}
    rounds: dict[str, list[Round]] = {target: [] for target in args.targets}
    workers = Workers(tokens, args)
    try:
        for index in range(args.rounds):
            order = args.targets if index % 2 == 0 else list(reversed(args.targets))
            for target in order:
                process, address = servers[target]
                rounds[target].append(workers.run_round(address, process.pid, f"r{index}", args.seconds / args.rounds))
        rejections = {target: full_rejections(target, address) for target, (_, address) in servers.items()}
    finally:
        workers.close()
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
    return [summarize(target, tokens, rounds[target], rejections[target]) for target in args.targets]


def full_rejections(target: str, address: str) -> int:
    """Put batches the buffer refused as full over all rounds (the echo server waits instead)."""
    if target != "buffer":
        return 0
    from stoker.buffer.client import BufferClient

    with BufferClient(address) as client:
        return int(client.stats().full_rejections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured duration per target and size")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds the duration is split into")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 32768], help="tokens per trajectory")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--window", type=int, default=2, help="Puts in flight per writer")
    parser.add_argument("--batch", type=int, default=8, help="trajectories per Put (one group)")
    parser.add_argument("--sample-groups", type=int, default=8, help="max groups per Sample")
    parser.add_argument("--capacity", type=int, default=1024, help="trajectories held by either server")
    parser.add_argument("--capacity-mb", type=float, default=64.0, help="...but at most this much data")
    parser.add_argument("--sync", choices=["batch", "none"], default="batch", help="the buffer's sync policy")
    parser.add_argument(
        "--targets", nargs="+", default=["echo", "echo-log", "buffer"], choices=["echo", "echo-log", "buffer"],
        help="echo-log: the echo server plus a durable append (group-committed fdatasync) of each Put",
    )
    parser.add_argument("--work-dir", type=Path, help="where the buffer's log goes (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--disk-seconds", type=float, default=3.0, help="length of the raw disk baseline per size (0: skip)")
    parser.add_argument("--logic-seconds", type=float, default=3.0, help="length of the in-process logic baseline per size (0: skip)")
    parser.add_argument("--echo-server", type=Path, help=argparse.SUPPRESS)  # internal: serve echo, ready file
    parser.add_argument("--echo-log", type=Path, help=argparse.SUPPRESS)  # internal: ...and log durably here
    args = parser.parse_args(argv)
    if args.echo_server:
        run_echo_server(args.echo_server, args.capacity, 256 << 20, args.echo_log)
        return 0
    results: list[CaseResult] = []
    disks: dict[int, dict[str, float]] = {}
    logic: dict[int, float] = {}
    with tempfile.TemporaryDirectory(dir=args.work_dir, prefix="buffer-bench-") as tmp:
        for tokens in args.sizes:
            if args.disk_seconds > 0:
                batch_bytes = args.batch * tokens * TRAJECTORY_BYTES_PER_TOKEN
                disk = disks[tokens] = disk_baseline(Path(tmp) / "disk", batch_bytes, args.disk_seconds)
                print(
                    f"    disk {tokens:>6} tokens: one writer, {batch_bytes / 1e6:.2f} MB + fdatasync: "
                    f"p50 {disk['append_p50_ms']:.2f} ms p99 {disk['append_p99_ms']:.2f} ms, "
                    f"{disk['durable_mb_per_s']:.0f} MB/s durable, "
                    f"{disk['cpu_us_per_append']:.0f} us CPU per {'direct ' if disk['direct'] else ''}append + fdatasync "
                    f"({disk['cpu_us_per_append'] / args.batch:.1f} us per trajectory)",
                    flush=True,
                )
            if args.logic_seconds > 0:
                logic[tokens] = logic_baseline(Path(tmp) / f"logic-{tokens}", tokens, args, args.logic_seconds)
                print(
                    f"   logic {tokens:>6} tokens: {logic[tokens]:.1f} us CPU per trajectory (split, validate, admit, log "
                    "write without the flush, store, Sample, encode, Commit; one thread, no gRPC)",
                    flush=True,
                )
            for result in run_size(tokens, args, Path(tmp)):
                results.append(result)
                print(
                    f"{result.target:>8} {tokens:>6} tokens: {result.put_trajectories_per_s:9.0f} traj/s "
                    f"{result.put_mb_per_s:8.1f} MB/s  put p50 {result.put_p50_ms:6.2f} ms p99 {result.put_p99_ms:6.2f} ms  "
                    f"read {result.read_trajectories_per_s:9.0f} traj/s  CPU us/traj: server {result.server_cpu_us_per_trajectory:7.1f} "
                    f"(kernel {result.server_system_cpu_us_per_trajectory:6.1f}, {result.server_switches_per_trajectory:4.2f} switches) "
                    f"clients {result.clients_cpu_us_per_trajectory:7.1f}  groups/Sample {result.groups_per_sample:4.1f}  "
                    f"full {result.full_rejections}",
                    flush=True,
                )
    by_case = {(r.target, r.tokens): r for r in results}
    summary = []
    for tokens in args.sizes:
        echo, buffer = by_case.get(("echo", tokens)), by_case.get(("buffer", tokens))
        if echo and buffer and echo.put_trajectories_per_s > 0:
            ratio = buffer.put_trajectories_per_s / echo.put_trajectories_per_s
            read_ratio = buffer.read_trajectories_per_s / max(echo.read_trajectories_per_s, 1e-9)
            entry = {"tokens": tokens, "put_ratio": ratio, "read_ratio": read_ratio}
            line = f"{tokens:>6} tokens: buffer/echo throughput {ratio:.2f}x (put), {read_ratio:.2f}x (read)"
            if durable := by_case.get(("echo-log", tokens)):
                entry["echo_log_ratio"] = durable.put_trajectories_per_s / echo.put_trajectories_per_s
                line += f"; echo-log/echo {entry['echo_log_ratio']:.2f}x"
            if tokens in logic:
                entry["logic_us_per_trajectory"] = logic[tokens]
                entry["logic_ceiling"] = ceiling(echo, logic[tokens])
                line += f"; one whose only cost was its logic ({logic[tokens]:.1f} us/traj): at most {entry['logic_ceiling']:.2f}x"
            summary.append(entry)
            print(line)
    if args.json:
        report = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "results": [asdict(r) for r in results],
            "ratios": summary,
            "disk": {str(k): v for k, v in disks.items()},
            "logic_us_per_trajectory": {str(k): v for k, v in logic.items()},
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
