"""The buffer against DeepMind Reverb 0.14, one trajectory at a time, in one run.

    python -m venv /work/tmp/buf/reverb-venv
    /work/tmp/buf/reverb-venv/bin/pip install "dm-reverb[tensorflow]==0.14.0"
    .venv/bin/python benchmarks/buffer_vs_reverb.py --reverb-python /work/tmp/buf/reverb-venv/bin/python

Writer processes insert trajectories into each target in turn (``reverb``: a Reverb FIFO queue
table; ``buffer``: ``stoker buffer`` over ``BufferClient.put_stream``; ``buffer-unary``: one unary
``Put`` per call) while one reader takes batches; it prints inserts/s, insert latency and CPU per
item for each. Reverb lives in its own virtual environment, never in the project's dependencies.
The load, the definitions and the figures: benchmarks/README.md, "The buffer against DeepMind Reverb".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoker.procstat import proc_stat

HERE = Path(__file__).resolve().parent
READY_TIMEOUT = 90.0
GROUP_SIZE = 8  # the actors' groups: one call per episode as it finishes, or the whole group at once


# ----------------------------------------------------------------------------- buffer clients


def episode_bytes(index: int, group: str, group_size: int, tokens: int, prefix: str) -> bytes:
    from stoker.buffer.wire import encode_trajectory
    from stoker.trajectory import Episode

    mask = np.ones(tokens, np.uint8)
    mask[: tokens // 4] = 0
    return encode_trajectory(
        Episode(
            episode_id=f"{prefix}-{index}",
            group_id=group,
            group_size=group_size,
            task_id="bench",
            token_ids=np.arange(tokens, dtype=np.int32),
            loss_mask=mask,
            logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
            policy_versions=np.where(mask == 1, 0, -1).astype(np.int32),
            reward=1.0,
            status=1,
        )
    )


def wait_for_go(args: argparse.Namespace) -> None:
    """Say this process is set up, then wait until every client is (see ``run_case``)."""
    Path(args.out + ".ready").touch()
    while not os.path.exists(args.go):
        time.sleep(0.01)


def buffer_writer(args: argparse.Namespace) -> None:
    from stoker.buffer.client import BufferClient, RetryPolicy

    client = BufferClient(args.address, client_id=f"w{os.getpid()}", retry=RetryPolicy(deadline=600))
    prefix = f"{os.getpid()}-{time.monotonic_ns()}"
    latencies: list[float] = []
    inserted = 0
    stream = client.put_stream(window=args.window) if args.mode == "stream" else None
    wait_for_go(args)
    start = time.monotonic()
    measure_from, stop_at = start + args.warmup, start + args.warmup + args.seconds
    cpu_start: float | None = None
    index = 0
    sent: collections.deque[tuple[float, Any]] = collections.deque()
    while (now := time.monotonic()) < stop_at:
        if cpu_start is None and now >= measure_from:
            cpu_start, inserted, latencies = time.process_time(), 0, []
        group = f"{prefix}-g{index // GROUP_SIZE}"
        raws = [episode_bytes(index + k, group, GROUP_SIZE, args.tokens, prefix) for k in range(args.per_call)]
        index += args.per_call
        began = time.monotonic()
        if stream is None:
            client.put_encoded(raws)
            latencies += [time.monotonic() - began] * len(raws)
            inserted += len(raws)
            continue
        for raw in raws:
            sent.append((began, stream.put(raw)))
        while len(sent) > max(0, args.window - args.per_call):
            sent_at, future = sent.popleft()
            future.result()
            latencies.append(time.monotonic() - sent_at)
            inserted += 1
    if stream is not None:
        stream.close()
    cpu = time.process_time() - (cpu_start or time.process_time())
    Path(args.out).write_text(json.dumps({"inserted": inserted, "latencies": latencies, "cpu": cpu, "seconds": args.seconds}))


def buffer_reader(args: argparse.Namespace) -> None:
    from stoker.buffer.client import BufferClient

    client = BufferClient(args.address, learner_id="bench-reader")
    wait_for_go(args)
    start = time.monotonic()
    measure_from, measure_to = start + args.warmup, start + args.warmup + args.seconds
    items = 0
    cpu_start: float | None = None
    reported = False
    pending = None
    while True:
        now = time.monotonic()
        if cpu_start is None and now >= measure_from:
            cpu_start, items = time.process_time(), 0
        if not reported and now >= measure_to:
            Path(args.out).write_text(json.dumps({"items": items, "cpu": time.process_time() - (cpu_start or 0.0), "seconds": args.seconds}))
            reported = True
        batch = client.sample(max_groups=max(1, args.batch // GROUP_SIZE), min_groups=1, timeout=1.0)
        if batch is None:
            continue
        items += len(batch.episodes)  # decoded to numpy arrays by the client
        if pending is not None:
            pending.result()
        pending = client.commit_async(batch.batch_id)


# ----------------------------------------------------------------------------- orchestration


def cpu_seconds(pid: int) -> float:
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ready(ready: Path, process: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().strip():
            return int(ready.read_text())
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        time.sleep(0.05)
    raise RuntimeError("server not ready in time")


def start_server(target: str, args: argparse.Namespace, work: Path, per_call: int) -> tuple[subprocess.Popen[bytes], int]:
    ready = work / f"ready-{target}-{time.monotonic_ns()}"
    if target == "reverb":
        command = [args.reverb_python, "-I", str(HERE / "reverb_peer.py"), "server", "--capacity", str(args.capacity), "--ready-file", str(ready)]
    else:
        manifest = work / "job.yaml"
        manifest.write_text(json.dumps({
            "apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob",
            "spec": {"buffer": {"groupSize": GROUP_SIZE, "capacity": args.capacity, "maxStaleness": 1000}},
        }))  # fmt: skip
        data = Path(tempfile.mkdtemp(dir=work, prefix="data-"))
        command = [sys.executable, "-m", "stoker.cli", "buffer", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data),
                   "--manifest", str(manifest), "--ready-file", str(ready), "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, wait_ready(ready, process)


def client_command(target: str, role: str, args: argparse.Namespace, port: int, per_call: int, out: Path) -> list[str]:
    common = ["--tokens", str(args.tokens), "--per-call", str(per_call), "--window", str(args.window), "--batch", str(args.batch),
              "--seconds", str(args.seconds), "--warmup", str(args.warmup), "--out", str(out), "--go", str(out.parent / "go")]  # fmt: skip
    if target == "reverb":
        return [args.reverb_python, "-I", str(HERE / "reverb_peer.py"), role, "--port", str(port), *common]
    mode = "stream" if target == "buffer" else "unary"
    return [sys.executable, str(Path(__file__).resolve()), role, "--address", f"127.0.0.1:{port}", "--mode", mode, *common]


def run_case(target: str, per_call: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    server, port = start_server(target, args, work, per_call)
    outs = [work / f"{target}-{per_call}-w{i}.json" for i in range(args.writers)]
    reader_out = work / f"{target}-{per_call}-r.json"
    go = work / "go"
    for path in [*outs, reader_out, go]:
        path.unlink(missing_ok=True)
        Path(str(path) + ".ready").unlink(missing_ok=True)
    try:
        reader = subprocess.Popen(client_command(target, "reader", args, port, per_call, reader_out))
        writers = [subprocess.Popen(client_command(target, "writer", args, port, per_call, out)) for out in outs]
        deadline = time.monotonic() + READY_TIMEOUT
        while not all(Path(str(p) + ".ready").exists() for p in [*outs, reader_out]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{target} clients not set up in time")
            time.sleep(0.02)
        go.touch()  # every client starts its clock now
        started = time.monotonic()
        time.sleep(args.warmup)
        server_cpu = cpu_seconds(server.pid)
        load_start = os.getloadavg()[0]
        time.sleep(args.seconds)
        server_cpu = cpu_seconds(server.pid) - server_cpu
        for writer in writers:
            writer.wait(timeout=args.seconds + 120)
        deadline = time.monotonic() + 30
        while not reader_out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        reader.kill()
        reader.wait()
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    results = [json.loads(out.read_text()) for out in outs]
    read = json.loads(reader_out.read_text())
    inserted = sum(r["inserted"] for r in results)
    latencies = np.array([x for r in results for x in r["latencies"]]) * 1000
    client_cpu = sum(r["cpu"] for r in results) + read["cpu"]
    return {
        "target": target,
        "per_call": per_call,
        "inserts_per_s": inserted / args.seconds,
        "p50_ms": float(np.percentile(latencies, 50)) if latencies.size else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99)) if latencies.size else float("nan"),
        "reader_items_per_s": read["items"] / args.seconds,
        "cpu_us_per_item": 1e6 * (server_cpu + client_cpu) / max(1, inserted),
        "server_cpu_us_per_item": 1e6 * server_cpu / max(1, inserted),
        "load": load_start,
        "wall": time.monotonic() - started,
    }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (shape, target): the mean of each figure over the rounds."""
    keys = sorted({(r["per_call"], r["target"]) for r in rows}, key=lambda k: (k[0], ["reverb", "buffer", "buffer-unary"].index(k[1])))
    out = []
    for per_call, target in keys:
        mine = [r for r in rows if (r["per_call"], r["target"]) == (per_call, target)]
        out.append({"per_call": per_call, "target": target, "rounds": len(mine),
                    **{k: float(np.mean([r[k] for r in mine])) for k in mine[0] if isinstance(mine[0][k], float)}})  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog='Method and figures: benchmarks/README.md, "The buffer against DeepMind Reverb".',
    )
    parser.add_argument("role", nargs="?", default="run", choices=["run", "writer", "reader"])
    parser.add_argument("--reverb-python", default="/work/tmp/buf/reverb-venv/bin/python", help="Python of Reverb's venv")
    parser.add_argument("--targets", nargs="+", default=["reverb", "buffer", "buffer-unary"])
    parser.add_argument("--per-call", type=int, nargs="+", default=[1, 8], help="trajectories per insert call (one case each)")
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per trajectory")
    parser.add_argument("--window", type=int, default=32, help="unconfirmed trajectories per writer")
    parser.add_argument("--batch", type=int, default=32, help="trajectories per reader batch")
    parser.add_argument("--capacity", type=int, default=1024, help="items the queue table / buffer holds")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the targets' order alternating")
    parser.add_argument("--json", type=Path)
    # for the client processes
    parser.add_argument("--address", default="")
    parser.add_argument("--mode", choices=["stream", "unary"], default="stream")
    parser.add_argument("--out", default="")
    parser.add_argument("--go", default="")
    args = parser.parse_args()
    if args.role == "writer":
        args.per_call = args.per_call[0]
        buffer_writer(args)
        return 0
    if args.role == "reader":
        args.per_call = args.per_call[0]
        buffer_reader(args)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="vs-reverb-") as tmp:
        work = Path(tmp)
        for round_number in range(args.rounds):
            for per_call in args.per_call:
                targets = args.targets if round_number % 2 == 0 else list(reversed(args.targets))
                for target in targets:
                    row = run_case(target, per_call, args, work)
                    row["round"] = round_number
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = summarize(rows)
    print(f"\n{'per call':>8} {'target':>13} {'inserts/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'reader/s':>9} {'CPU us/item':>12} {'server us/item':>15}")
    for s in summary:
        print(f"{s['per_call']:>8} {s['target']:>13} {s['inserts_per_s']:>10.0f} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} "
              f"{s['reader_items_per_s']:>9.0f} {s['cpu_us_per_item']:>12.0f} {s['server_cpu_us_per_item']:>15.0f}")  # fmt: skip
    for per_call in args.per_call:
        reverb = next((s for s in summary if s["target"] == "reverb" and s["per_call"] == per_call), None)
        for s in summary:
            if reverb and s["per_call"] == per_call and s["target"] != "reverb":
                print(f"per call {per_call}: {s['target']} / reverb inserts/s = {s['inserts_per_s'] / reverb['inserts_per_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
