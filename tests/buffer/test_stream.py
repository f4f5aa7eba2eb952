"""``PutStream``: trajectories put one at a time, acknowledged per durable flush; refusals are
per batch and the stream goes on; exactly once across a ``kill -9`` of the buffer mid-stream."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from typing import Any

import grpc
import pytest

import stoker.buffer.wal as wal_module
from stoker.buffer.client import BufferClient, InvalidTrajectoryError, RetryPolicy
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import encode_put_request, encode_put_stream_request, encode_trajectory
from stoker.trajectory import Episode, to_proto
from stoker.v1 import buffer_pb2

ServerFactory = Callable[..., BufferServer]
EpisodeFactory = Callable[..., Episode]


def drain(client: BufferClient) -> list[str]:
    """Every stored episode id, sampled and committed."""
    ids: list[str] = []
    while (batch := client.sample(max_groups=64, min_groups=1, timeout=0)) is not None:
        ids += [e.episode_id for e in batch.episodes]
        client.commit(batch.batch_id)
    return ids


def test_each_trajectory_is_acknowledged_once_durable_and_an_invalid_one_alone_is_refused(
    server_factory: ServerFactory, settings: BufferSettings, make_episode: EpisodeFactory
) -> None:
    server = server_factory(replace(settings, group_size=1))
    with BufferClient(f"127.0.0.1:{server.port}", client_id="actor") as client:
        episodes = [make_episode(group_size=1) for _ in range(20)]
        bad = to_proto(make_episode(group_size=1))
        bad.logprobs = b"\x00" * 3  # not one float32 per token
        with client.put_stream(window=8) as stream:
            acks = [stream.put(e) for e in episodes[:10]] + [stream.put(bad)] + [stream.put(e) for e in episodes[10:]]
        assert [f.exception() for f in acks[:10] + acks[11:]] == [None] * 20
        refused = acks[10].exception()
        assert isinstance(refused, InvalidTrajectoryError) and refused.fields == ["logprobs"]
        assert sorted(drain(client)) == sorted(e.episode_id for e in episodes)


def test_an_acknowledgement_means_the_trajectory_was_flushed(
    server_factory: ServerFactory, settings: BufferSettings, make_episode: EpisodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = server_factory(replace(settings, group_size=1))
    held = threading.Event()
    real_fdatasync = wal_module.os.fdatasync

    def held_disk(fd: int) -> None:
        held.wait(30)
        real_fdatasync(fd)

    with BufferClient(f"127.0.0.1:{server.port}") as client, client.put_stream() as stream:
        monkeypatch.setattr(wal_module.os, "fdatasync", held_disk)
        ack = stream.put(make_episode(group_size=1))
        with pytest.raises(futures.TimeoutError):
            ack.result(timeout=0.5)  # written, but its flush has not returned
        held.set()
        assert ack.result(timeout=30) is None
        monkeypatch.setattr(wal_module.os, "fdatasync", real_fdatasync)


def test_a_full_buffer_holds_the_stream_back_until_there_is_room(
    server_factory: ServerFactory, settings: BufferSettings, make_episode: EpisodeFactory
) -> None:
    server = server_factory(replace(settings, group_size=1, capacity=4))
    episodes = [make_episode(group_size=1) for _ in range(30)]
    seen: list[str] = []
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        with client.put_stream(window=8) as stream:
            acks = [stream.put(e) for e in episodes[:8]]  # twice the capacity: some are refused as full, then resent
            while len(seen) < 30:
                batch = client.sample(max_groups=4, min_groups=1, timeout=10)
                assert batch is not None, "the stream stopped sending"
                seen += [e.episode_id for e in batch.episodes]
                client.commit(batch.batch_id)
                if len(acks) < 30:
                    acks += [stream.put(e) for e in episodes[len(acks) : len(acks) + 4]]
        assert all(f.exception() is None for f in acks)
        assert client.stats().full_rejections > 0
    assert sorted(seen) == sorted(e.episode_id for e in episodes)


def test_a_malformed_stream_message_ends_the_stream_with_invalid_argument(
    server_factory: ServerFactory, settings: BufferSettings, make_episode: EpisodeFactory
) -> None:
    server = server_factory(replace(settings, group_size=1))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_stream("/stoker.v1.Buffer/PutStream")
        good = encode_put_stream_request(7, "x", [encode_trajectory(make_episode(group_size=1))])
        responses = call(iter([good, b"\x12\xff\xff"]), timeout=10)
        with pytest.raises(grpc.RpcError) as ended:
            for response in responses:
                buffer_pb2.PutStreamResponse.FromString(response)
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed PutStreamRequest" in (ended.value.details() or "")
        # A sequence no uint64 holds (2^64, a 10-byte varint): malformed too, not INTERNAL.
        huge = encode_put_request("x", [encode_trajectory(make_episode(group_size=1))]) + b"\x18" + b"\x80" * 9 + b"\x02"
        with pytest.raises(grpc.RpcError) as ended:
            for response in call(iter([huge]), timeout=10):
                buffer_pb2.PutStreamResponse.FromString(response)
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ended.value.details()
        assert "varint above 2^64" in (ended.value.details() or "")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_exactly_once_across_a_kill_9_of_the_buffer_mid_stream(
    buffer_process: Callable[..., Any], tmp_path: Any, make_group: Callable[..., list[Episode]]
) -> None:
    port = free_port()
    data = tmp_path / "data"
    first = buffer_process(data, "--port", str(port), group_size=2)
    episodes = [e for _ in range(300) for e in make_group(2, tokens=256)]
    client = BufferClient(f"127.0.0.1:{port}", client_id="actor", retry=RetryPolicy(deadline=60))
    stream = client.put_stream(window=32)
    acks = [stream.put(e) for e in episodes[:300]]
    acks[150].result(timeout=60)
    acknowledged = [e.episode_id for e, ack in zip(episodes, acks, strict=False) if ack.done()]
    first.kill()  # mid-stream: up to 32 trajectories sent and not acknowledged
    buffer_process(data, "--port", str(port), group_size=2)
    acks += [stream.put(e) for e in episodes[300:]]
    stream.close()
    assert all(ack.exception() is None for ack in acks)
    delivered = drain(client)
    assert len(delivered) == len(set(delivered)) == 600  # none lost, none twice
    assert set(acknowledged) <= set(delivered)
    client.close()
