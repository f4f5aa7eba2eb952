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
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from buffer_baselines import disk_baseline, logic_baseline
from buffer_echo import run_echo_server
from buffer_load import READY_TIMEOUT, TRAJECTORY_BYTES_PER_TOKEN, Round, Workers


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
