"""How soon buffer clients come back after the buffer restarts: gRPC's default reconnect backoff
against Stoker's bounded one (``stoker.channels``), side by side in one run.

    .venv/bin/python benchmarks/reconnect.py                       # 4 cycles of 15 s down / 3 s up
    .venv/bin/python benchmarks/reconnect.py --cycles 2 --down 6 --up 3 --kill

One buffer (``stoker buffer``, a real process on a fixed loopback port) is stopped (SIGTERM, or
SIGKILL with ``--kill``) and started again on the same port, ``--cycles`` times. Two long-lived
``BufferClient``s call ``Stats`` in a loop throughout (each call retried by the client's own
``RetryPolicy``): ``baseline`` built with gRPC's default channel options, ``bounded`` with
Stoker's. After each restart a third and fourth client are created in the same process (each kind
again), as a learner or actor that reconnects by building a new client would. Reported per cycle
and kind: seconds from the buffer being ready (its ready file written) to the client's first
successful call, or ``>up`` when it did not come back before the next outage; after the last
restart the buffer stays up, and how long each long-lived client took to come back at all.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

from stoker.buffer.client import BufferClient, RetryPolicy

RETRY = RetryPolicy(initial=0.05, maximum=2.0, deadline=3600.0)  # the client's default pacing, never giving up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Buffer:
    def __init__(self, work: Path, port: int):
        self.work, self.port = work, port
        manifest = work / "job.yaml"
        manifest.write_text(json.dumps({"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "spec": {}}))
        self.manifest = manifest
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it; the monotonic time it was ready."""
        ready = self.work / f"ready-{time.monotonic_ns()}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "stoker.cli", "buffer", "--host", "127.0.0.1", "--port", str(self.port),
             "--data-dir", str(self.work / "data"), "--manifest", str(self.manifest), "--ready-file", str(ready)],
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not ready.exists():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError("the buffer did not start")
            time.sleep(0.01)  # polling the ready file
        return time.monotonic()

    def stop(self, kill: bool) -> None:
        assert self.process is not None
        self.process.kill() if kill else self.process.terminate()
        self.process.wait(30)


def client(address: str, kind: str, retry: RetryPolicy = RETRY) -> BufferClient:
    if kind == "bounded":
        return BufferClient(address, retry=retry)
    with mock.patch("stoker.buffer.client.channel_options", lambda extra=(): list(extra)):  # gRPC's defaults
        return BufferClient(address, retry=retry)


class Poller:
    """Calls Stats in a loop; ``recovered_after(t)`` is the first success at or after ``t``."""

    def __init__(self, buffer: BufferClient):
        self.buffer = buffer
        self.successes: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.buffer.stats()
                self.successes.append(time.monotonic())
            except Exception:  # noqa: BLE001 - a failed call is what is measured
                pass
            self.stop.wait(0.02)

    def recovered_after(self, t: float, until: float) -> float | None:
        first = next((s for s in self.successes if s >= t), None)
        return None if first is None or first > until else first - t


def first_call(fresh: BufferClient) -> float | None:
    """A new client's first successful call, seconds from now (None if it gave up)."""
    started = time.monotonic()
    try:
        fresh.stats()
        return time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - not back before the next outage
        print(f"a new client: {exc}", file=sys.stderr)
        return None
    finally:
        fresh.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--down", type=float, default=15.0, help="seconds the buffer stays down")
    parser.add_argument("--up", type=float, default=3.0, help="seconds it stays up before the next outage")
    parser.add_argument("--kill", action="store_true", help="SIGKILL instead of SIGTERM")
    parser.add_argument("--settle", type=float, default=150.0, help="after the last restart, wait this long for every client")
    args = parser.parse_args()
    kinds = ("baseline", "bounded")
    with tempfile.TemporaryDirectory() as work:
        buffer = Buffer(Path(work), free_port())
        buffer.start()
        address = f"127.0.0.1:{buffer.port}"
        pollers = {kind: Poller(client(address, kind)) for kind in kinds}
        rows = []
        for cycle in range(1, args.cycles + 1):
            time.sleep(args.up)  # the buffer serving between outages
            buffer.stop(args.kill)
            time.sleep(args.down)  # the outage, clients retrying throughout
            ready = buffer.start()
            until = ready + args.up
            fresh: dict[str, float | None] = {}
            # Built here, one after the other (the baseline's options are patched in module-wide);
            # a channel connects on its first call, which the threads make at the same time.
            give_up = RetryPolicy(initial=RETRY.initial, maximum=RETRY.maximum, deadline=args.up)
            clients = {k: client(address, k, give_up) for k in kinds}
            threads = [threading.Thread(target=lambda k=k: fresh.__setitem__(k, first_call(clients[k]))) for k in kinds]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(max(0.0, until - time.monotonic()))
            rows.append((cycle, {k: pollers[k].recovered_after(ready, until) for k in kinds}, fresh))
        # The buffer now stays up: how long each long-lived client takes to come back at all.
        deadline = ready + args.settle
        while time.monotonic() < deadline and any(p.recovered_after(ready, deadline) is None for p in pollers.values()):
            time.sleep(0.1)  # polling the pollers' records
        settled = {k: pollers[k].recovered_after(ready, deadline) for k in kinds}
        for poller in pollers.values():
            poller.stop.set()
        buffer.stop(kill=True)

    def show(value: float | None) -> str:
        return f">{args.up:g}" if value is None else f"{value:.2f}"

    print(f"{args.cycles} cycles, {args.down:g} s down / {args.up:g} s up, {'SIGKILL' if args.kill else 'SIGTERM'}")
    print("| cycle | long-lived, gRPC default s | long-lived, bounded s | new client, gRPC default s | new client, bounded s |")
    print("|---|---|---|---|---|")
    for cycle, long_lived, fresh in rows:
        print(f"| {cycle} | {show(long_lived['baseline'])} | {show(long_lived['bounded'])} | "
              f"{show(fresh['baseline'])} | {show(fresh['bounded'])} |")
    final = {k: "never" if v is None else f"{v:.2f} s" for k, v in settled.items()}
    print(f"after the last restart (buffer up from then on), long-lived clients back after: "
          f"gRPC default {final['baseline']}, bounded {final['bounded']} (waited up to {args.settle:g} s)")


if __name__ == "__main__":
    main()
