"""Clients come back soon after the buffer does: real gRPC servers over loopback, stopped (or
``kill -9``-ed) and started again on the same port while clients keep calling.

The bound each recovery is held to is the configured reconnect backoff (``stoker.channels``: the
longest wait between connection attempts, jitter included) plus a margin for a loaded machine;
gRPC's default backoff (up to 120 s, shared by every channel of the process) missed it by seconds
to minutes. Each outage lasts long enough that the default backoff would have grown past it.
"""

from __future__ import annotations

import itertools
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from stoker.buffer import service
from stoker.buffer.client import BufferClient, BufferClientError, LeaseLostError, RetryPolicy
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.channels import RECONNECT_BOUND_SECONDS
from stoker.trajectory import Episode

MARGIN_SECONDS = 1.0  # connect, one RPC, a busy 2-core machine
BOUND = RECONNECT_BOUND_SECONDS + MARGIN_SECONDS
FRESH_CLIENT_BOUND = MARGIN_SECONDS  # a new client connects at once: it shares no backoff
# With gRPC's default backoff (1 s x 1.6 per attempt), a client retrying through a 10 s outage next
# tries 5.8 s (+-2.3 s) after the server is back: far outside BOUND.
LONG_OUTAGE_SECONDS = 10.0
SHORT_OUTAGE_SECONDS = 2.0

_ids = itertools.count()


def episode(group_size: int = 1) -> list[Episode]:
    group = f"g-{next(_ids)}"
    mask = np.ones(8, np.uint8)
    return [
        Episode(episode_id=f"{group}-e{k}", group_id=group, group_size=group_size, task_id="t",
                token_ids=np.arange(8, dtype=np.int32), loss_mask=mask, logprobs=np.full(8, -0.1, np.float32),
                policy_versions=np.zeros(8, np.int32))
        for k in range(group_size)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Poller:
    """Makes one call after another in a thread; ``back_since(t, bound)`` waits for a call that
    returned after ``t``. The call's own client retries through an outage."""

    def __init__(self, call: Callable[[], object]):
        self.call = call
        self.last = -math.inf
        self.errors: list[BaseException] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.call() is not False:
                    with self._cond:
                        self.last = time.monotonic()
                        self._cond.notify_all()
            except Exception as exc:  # noqa: BLE001 - the test fails on any, after the run
                self.errors.append(exc)
            self._stop.wait(0.01)  # pacing between calls, not a wait for anything

    def back_since(self, since: float, bound: float) -> float | None:
        """Seconds from ``since`` to the first call that returned after it; None if none did by
        ``since + bound``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.last > since, max(0.0, since + bound - time.monotonic())):
                return None
            return self.last - since

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


@pytest.fixture
def pollers() -> Iterator[list[Poller]]:
    started: list[Poller] = []
    yield started
    for poller in started:
        poller.stop()


@pytest.mark.slow
def test_clients_come_back_within_the_backoff_bound_after_repeated_restarts(tmp_path: Path, pollers: list[Poller]) -> None:
    settings = BufferSettings(group_size=1, capacity=1 << 20, max_staleness=100, batch_groups=1)
    port = free_port()
    address = f"127.0.0.1:{port}"

    def start() -> BufferServer:
        return BufferServer(settings, tmp_path / "data", host="127.0.0.1", port=port).start()

    server = start()
    caller = BufferClient(address)  # the default RetryPolicy: retries for 120 s
    writer = BufferClient(address, client_id="writer")
    stream = writer.put_stream()
    pollers += [Poller(caller.stats), Poller(lambda: stream.put(episode()[0]).result(timeout=120))]
    try:
        for outage in (LONG_OUTAGE_SECONDS, SHORT_OUTAGE_SECONDS, LONG_OUTAGE_SECONDS):
            assert all(p.back_since(time.monotonic(), BOUND) is not None for p in pollers), "not serving before the outage"
            server.stop(grace=0)
            threading.Event().wait(outage)  # the outage itself, the clients retrying throughout
            server = start()
            back = time.monotonic()
            # A new client's very first attempt (no retry) connects: it inherits no other
            # client's backoff (a shared subchannel in backoff would fail it at once).
            with BufferClient(address, retry=RetryPolicy(deadline=0.0)) as fresh:
                fresh.stats()
                fresh_seconds = time.monotonic() - back
            recovered = [p.back_since(back, BOUND) for p in pollers]
            assert None not in recovered and fresh_seconds < FRESH_CLIENT_BOUND, (
                f"after a {outage:g} s outage: Stats, PutStream back after {recovered} (None: not within {BOUND:.1f} s);"
                f" a new client's first call took {fresh_seconds:.2f} s (bound {FRESH_CLIENT_BOUND:.1f} s)"
            )
        assert not [e for p in pollers for e in p.errors], "a call gave up"
    finally:
        for poller in pollers:
            poller.stop()
        stream.close()
        caller.close()
        writer.close()
        server.stop(grace=0)


@pytest.mark.slow
def test_writers_and_the_reader_come_back_after_kill_9(buffer_process: Callable[..., Any], tmp_path: Path,
                                                       pollers: list[Poller]) -> None:
    """The buffer's pod killed: its process dies without a word (connection reset, then refused),
    and a new one starts on the same address. A Put writer, a PutStream writer and the learner's
    Sample/Commit loop all carry on against it within the bound."""
    port = free_port()
    data = tmp_path / "data"
    server = buffer_process(data, "--port", str(port), group_size=2)
    address = f"127.0.0.1:{port}"
    putter, streamer, reader = (BufferClient(address, client_id="putter"), BufferClient(address, client_id="streamer"),
                                BufferClient(address, learner_id="learner"))
    stream = streamer.put_stream()

    def stream_group() -> None:
        for future in [stream.put(e) for e in episode(2)]:
            future.result(timeout=120)

    def learn() -> bool:
        batch = reader.sample(4, 1, timeout=0.5)
        if batch is None:
            return False  # nothing yet: not a successful round
        try:
            reader.commit(batch.batch_id)
        except LeaseLostError:
            return False  # leased from the killed process: it delivers those groups again
        return True

    pollers += [Poller(lambda: putter.put(episode(2))), Poller(stream_group), Poller(learn)]
    try:
        for outage in (LONG_OUTAGE_SECONDS, 0.0):
            assert all(p.back_since(time.monotonic(), 30) is not None for p in pollers), "not serving before the kill"
            server.kill()
            threading.Event().wait(outage)  # the outage itself (plus a new process's start), the clients retrying
            server = buffer_process(data, "--port", str(port), group_size=2)
            back = time.monotonic()
            recovered = [p.back_since(back, BOUND) for p in pollers]
            assert None not in recovered, (
                f"after kill -9 and {outage:g} s: Put, PutStream, Sample+Commit back after {recovered}"
                f" (None: not within {BOUND:.1f} s)"
            )
        assert not [e for p in pollers for e in p.errors], "a call gave up"
    finally:
        for poller in pollers:
            poller.stop()
        stream.close()
        for client in (putter, streamer, reader):
            client.close()


def test_a_retry_goes_out_once_the_channel_reconnects_not_after_its_whole_backoff(tmp_path: Path) -> None:
    """``BufferClient.pause`` after UNAVAILABLE on a channel that lost its connection ends when gRPC
    has reconnected; on a connected channel (the buffer itself said UNAVAILABLE) it waits it out."""
    import grpc

    settings = BufferSettings(group_size=1, capacity=64, max_staleness=2, batch_groups=1)
    port = free_port()

    def start() -> BufferServer:
        return BufferServer(settings, tmp_path / "data", host="127.0.0.1", port=port).start()

    server = start()
    with BufferClient(f"127.0.0.1:{port}", retry=RetryPolicy(deadline=0.0)) as client:
        client.stats()
        started = time.monotonic()
        client.pause(0.3, grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - started >= 0.3  # connected: the whole delay
        server.stop(grace=0)
        with pytest.raises(BufferClientError):
            client.stats()  # the connection is gone; gRPC is backing off
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (client.pause(60.0, grpc.StatusCode.UNAVAILABLE), done.set()))
        waiter.start()
        server = start()
        try:
            back = time.monotonic()
            assert done.wait(BOUND), f"still pausing {BOUND:.1f} s after the buffer came back"
            assert time.monotonic() - back < BOUND
            client.stats()
        finally:
            waiter.join(60)
            server.stop(grace=0)


def test_a_call_the_stopping_buffer_cancels_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer that stops with calls in flight may answer them CANCELLED (its GOAWAY cancels every
    call), not UNAVAILABLE: the caller's Stats must come back, not raise."""
    answered = service.BufferService.stats
    calls = itertools.count()

    async def cancelled_once(self: Any, request: Any, context: Any) -> Any:
        if next(calls) == 0:
            await context.abort(grpc.StatusCode.CANCELLED, "Cancelling all calls")
        return await answered(self, request, context)

    monkeypatch.setattr(service.BufferService, "stats", cancelled_once)
    settings = BufferSettings(group_size=1, capacity=1 << 20, max_staleness=100, batch_groups=1)
    server = BufferServer(settings, tmp_path / "data", host="127.0.0.1", port=(port := free_port())).start()
    try:
        client = BufferClient(f"127.0.0.1:{port}", retry=RetryPolicy(deadline=30.0))
        assert client.stats().policy_version == 0
        assert next(calls) == 2, "the cancelled call was not sent again"
        client.close()
    finally:
        server.stop(grace=0)
