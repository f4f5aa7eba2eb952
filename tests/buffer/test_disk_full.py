"""A full log volume is a state, not a wedge: Puts are refused with RESOURCE_EXHAUSTED while
Commits go through, Stats and /metrics say so, consumption frees the space by itself, and a
restart on a full volume succeeds. Run on a small tmpfs (skipped where it cannot be mounted)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from stoker.buffer.client import BufferClient
from stoker.buffer.core import BufferCore
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.buffer.state import DiskFull
from stoker.buffer.wire import encode_put_request, encode_trajectory
from stoker.trajectory import Episode
from stoker.v1 import buffer_pb2

Groups = Callable[..., list[Episode]]
VOLUME_BYTES = 6 << 20
TOKENS = 8192  # ~106 KB per trajectory: the volume holds a few dozen groups


@pytest.fixture
def volume(tmpfs: Callable[[int], Path]) -> Path:
    """A 6 MiB tmpfs mounted for the test."""
    return tmpfs(VOLUME_BYTES) / "data"


@pytest.fixture
def small(settings: BufferSettings) -> BufferSettings:
    return replace(
        settings, capacity=10_000, max_staleness=1000, segment_bytes=1 << 20, disk_reserve_bytes=256 << 10, max_message_bytes=8 << 20
    )


def fill_until_disk_full(core: BufferCore, make_group: Groups) -> int:
    """Put groups until the volume refuses one; returns the groups stored."""
    for stored in range(1000):
        try:
            core.put([encode_trajectory(e) for e in make_group(2, tokens=TOKENS)])
        except DiskFull:
            return stored
    raise AssertionError("the volume never filled up")


def fill_the_rest(directory: Path) -> None:
    """Take every byte left on the volume (a crash leaves it this way when other files grew)."""
    with open(directory.parent / "ballast", "ab", buffering=0) as ballast:
        for size in (1 << 20, 64 << 10, 4 << 10, 512):
            try:
                while True:
                    ballast.write(bytes(size))
            except OSError:
                pass


def consume_everything(core: BufferCore) -> int:
    committed = 0
    while (batch := core.sample(16, 1, 0)) is not None:
        committed += core.commit(batch.batch_id)
    return committed


def test_a_full_volume_refuses_puts_takes_commits_reports_it_and_recovers_by_itself(
    volume: Path, small: BufferSettings, make_group: Groups
) -> None:
    server = BufferServer(small, volume, metrics_port=0).start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        raw_put = channel.unary_unary("/stoker.v1.Buffer/Put", request_serializer=bytes, response_deserializer=buffer_pb2.PutResponse.FromString)

        def put_group() -> grpc.StatusCode:
            request = encode_put_request("test", [encode_trajectory(e) for e in make_group(2, tokens=TOKENS)])
            try:
                raw_put(request, timeout=10)
            except grpc.RpcError as exc:
                assert "disk full" in (exc.details() or ""), exc.details()
                return exc.code()
            return grpc.StatusCode.OK

        stored = 0
        while (code := put_group()) == grpc.StatusCode.OK:
            stored += 1
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and stored > 5
        assert put_group() == grpc.StatusCode.RESOURCE_EXHAUSTED  # a state: still refused
        with BufferClient(f"127.0.0.1:{server.port}") as client:
            stats = client.stats()
            assert stats.disk_full and stats.disk_full_rejections >= 2 and stats.stored_trajectories == 2 * stored
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
            assert "stoker_buffer_disk_full 1.0" in metrics
            committed = 0
            while (batch := client.sample(max_groups=4, min_groups=1, timeout=0)) is not None:
                committed += client.commit(batch.batch_id)  # Commits go through on the full volume
            assert committed == 2 * stored
            deadline = time.monotonic() + 30
            while client.stats().disk_full:  # the buffer's housekeeping (every second) frees the space
                assert time.monotonic() < deadline, "the log never freed the consumed space"
                time.sleep(0.1)
            assert put_group() == grpc.StatusCode.OK
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
            assert "stoker_buffer_disk_full 0.0" in metrics
        channel.close()
    finally:
        server.stop(grace=0)


def test_a_restart_on_a_volume_full_of_consumed_segments_succeeds_and_takes_puts(
    volume: Path, small: BufferSettings, make_group: Groups
) -> None:
    core = BufferCore(small, volume)
    core.open()
    stored = fill_until_disk_full(core, make_group)
    assert consume_everything(core) == 2 * stored
    # A crash (no close, no housekeeping): the consumed segments are still on the volume.
    fill_the_rest(volume)
    restarted = BufferCore(small, volume)
    restarted.open()
    assert restarted.put([encode_trajectory(e) for e in make_group(2, tokens=TOKENS)]).stored == 2
    assert not restarted.stats().disk_full
    restarted.close()
    core.wal.close()


def test_a_restart_on_a_volume_full_of_live_trajectories_succeeds_and_keeps_them(
    volume: Path, small: BufferSettings, make_group: Groups
) -> None:
    core = BufferCore(small, volume)
    core.open()
    stored = fill_until_disk_full(core, make_group)
    # a crash: no close, so the active segment keeps its preallocated tail
    fill_the_rest(volume)
    restarted = BufferCore(small, volume)
    restarted.open()
    assert restarted.stats().stored_trajectories == 2 * stored
    with pytest.raises(DiskFull):
        restarted.put([encode_trajectory(e) for e in make_group(2, tokens=TOKENS)])
    assert consume_everything(restarted) == 2 * stored  # Commits go through
    restarted.tick()
    assert not restarted.stats().disk_full
    assert restarted.put([encode_trajectory(e) for e in make_group(2, tokens=TOKENS)]).stored == 2
    restarted.close()
