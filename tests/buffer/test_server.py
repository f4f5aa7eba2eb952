"""The gRPC service through the client library: batches with bad trajectories, auth, TLS,
backpressure, size limits, sampling and committing, health and metrics."""

from __future__ import annotations

import shutil
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import stoker.buffer.wal as wal_module
from stoker.buffer.client import (
    AuthError,
    BufferClient,
    BufferClientError,
    BufferUnavailableError,
    InvalidTrajectoryError,
    LeaseLostError,
    RetryPolicy,
)
from stoker.buffer.server import BufferServer, TlsFiles
from stoker.buffer.settings import BufferSettings
from stoker.trajectory import Episode, to_proto
from stoker.v1 import buffer_pb2, trajectory_pb2

Groups = Callable[..., list[Episode]]
ServerFactory = Callable[..., BufferServer]


def corrupt(episode: Episode, field: str) -> trajectory_pb2.Trajectory:
    """A wire trajectory with one thing wrong, named by the field the buffer must blame."""
    message = to_proto(episode)
    if field == "logprobs":
        message.logprobs = np.full(episode.num_tokens, np.nan, np.float32).tobytes()
    elif field == "token_ids":
        message.token_ids = message.token_ids[:-4]
    elif field == "loss_mask":
        message.loss_mask = bytes(episode.num_tokens)
    elif field == "group_size":
        message.group_size = 5
    elif field == "num_tokens":
        message.num_tokens = 0
    elif field == "status":
        message.status = trajectory_pb2.EPISODE_STATUS_UNSPECIFIED
    elif field == "episode_id":
        message.episode_id = ""
    return message


@pytest.mark.parametrize("field", ["logprobs", "token_ids", "loss_mask", "group_size", "num_tokens", "status", "episode_id"])
def test_bad_trajectory_is_refused_by_field_and_its_neighbours_are_stored(
    buffer: BufferClient, make_group: Groups, field: str
) -> None:
    good, bad_source = make_group(2), make_group(2)
    with pytest.raises(InvalidTrajectoryError) as caught:
        buffer.put([good[0], corrupt(bad_source[0], field), good[1]])
    error = caught.value
    assert error.fields == [field]
    assert error.rejections[0].index == 1
    assert field in str(error)
    assert error.stored == 2
    batch = buffer.sample(4, 1, timeout=1)  # the good group is whole and served
    assert batch is not None and [g.group_id for g in batch.groups] == [good[0].group_id]
    assert buffer.stats().rejected[field] == 1


def test_rpc_status_names_the_first_bad_trajectory(server_factory: ServerFactory, settings: BufferSettings, make_group: Groups) -> None:
    server = server_factory(settings)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    put = channel.unary_unary("/stoker.v1.Buffer/Put", request_serializer=lambda m: m.SerializeToString(), response_deserializer=buffer_pb2.PutResponse.FromString)
    episodes = make_group(2)
    request = buffer_pb2.PutRequest(trajectories=[to_proto(episodes[0]), corrupt(episodes[1], "logprobs")])
    with pytest.raises(grpc.RpcError) as caught:
        put(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "trajectories[1]: logprobs" in caught.value.details()
    trailer = dict(caught.value.trailing_metadata())["stoker-put-response-bin"]
    results = buffer_pb2.PutResponse.FromString(trailer)
    assert [r.code for r in results.results] == [0, 3] and results.stored == 1
    channel.close()


def test_a_client_sending_garbage_does_not_disturb_others(server_factory: ServerFactory, settings: BufferSettings, make_group: Groups) -> None:
    server = server_factory(settings)
    address = f"127.0.0.1:{server.port}"
    channel = grpc.insecure_channel(address)
    raw_put = channel.unary_unary("/stoker.v1.Buffer/Put", request_serializer=bytes, response_deserializer=buffer_pb2.PutResponse.FromString)
    with BufferClient(address) as client:
        for garbage in (b"\x12\x10short", b"\xff\xff\xff\xff", b"\x12\x03abc"):
            with pytest.raises(grpc.RpcError) as caught:
                raw_put(garbage)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.put(make_group(2)).stored == 2
    channel.close()


def test_auth_requires_the_bearer_token(server_factory: ServerFactory, settings: BufferSettings, make_group: Groups) -> None:
    server = server_factory(settings, token="s3cret")
    address = f"127.0.0.1:{server.port}"
    for token in (None, "wrong"):
        with BufferClient(address, token=token) as client:
            with pytest.raises(AuthError):
                client.put(make_group(2))
            with pytest.raises(AuthError):
                client.stats()
            with pytest.raises(AuthError):
                client.sample(1, timeout=0)
    with BufferClient(address, token="s3cret") as client:
        client.wait_ready(5)  # health needs no token (Kubernetes probes send none)
        assert client.put(make_group(2)).stored == 2
        assert client.stats().stored_trajectories == 2


def test_full_buffer_pushes_back_and_the_client_backs_off_until_there_is_room(
    server_factory: ServerFactory, settings: BufferSettings, make_group: Groups
) -> None:
    server = server_factory(replace(settings, capacity=4, retry_after_seconds=0.01))
    address = f"127.0.0.1:{server.port}"
    with BufferClient(address, retry=RetryPolicy(initial=0.01, maximum=0.05, deadline=0.3)) as client:
        client.put(make_group(2) + make_group(2))
        blocked = make_group(2)
        with pytest.raises(BufferUnavailableError, match="RESOURCE_EXHAUSTED"):
            client.put(blocked)  # still full when the retry deadline passes
        assert client.stats().full_rejections >= 1
    with BufferClient(address, retry=RetryPolicy(initial=0.01, maximum=0.05, deadline=30)) as writer, BufferClient(address) as learner:
        done = threading.Event()
        result: list[int] = []

        def write() -> None:
            result.append(writer.put(blocked).stored)
            done.set()

        thread = threading.Thread(target=write)
        thread.start()
        batch = learner.sample(1, timeout=5)
        assert batch is not None
        learner.commit(batch.batch_id)  # room for the waiting writer
        assert done.wait(30)
        thread.join()
        assert result == [2]


def test_message_size_limit_is_enforced(server_factory: ServerFactory, settings: BufferSettings, make_group: Groups) -> None:
    server = server_factory(replace(settings, max_message_bytes=64 * 1024))
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(BufferClientError, match="larger than max"):
            client.put(make_group(2, tokens=8000))  # ~100 KB each
        assert client.put(make_group(2)).stored == 2


def test_sample_commit_and_lost_lease(buffer: BufferClient, make_group: Groups) -> None:
    groups = [make_group(2, tokens=12) for _ in range(3)]
    buffer.put([e for g in groups for e in g])
    assert buffer.sample(5, min_groups=4, timeout=0.2) is None  # only 3 complete groups
    batch = buffer.sample(2, min_groups=2, timeout=1)
    assert batch is not None
    assert [g.group_id for g in batch.groups] == [groups[0][0].group_id, groups[1][0].group_id]
    first = batch.groups[0].episodes[0]
    np.testing.assert_array_equal(first.token_ids, groups[0][0].token_ids)
    np.testing.assert_array_equal(first.logprobs, groups[0][0].logprobs)
    assert buffer.commit_async(batch.batch_id).result(10) == 4
    with pytest.raises(LeaseLostError):
        buffer.commit(batch.batch_id)
    stats = buffer.stats()
    assert (stats.committed_total, stats.stored_trajectories, stats.complete_groups) == (4, 2, 1)


def test_sample_waits_for_groups_to_arrive(buffer: BufferClient, make_group: Groups) -> None:
    got: list[object] = []
    waiting = threading.Thread(target=lambda: got.append(buffer.sample(1, timeout=10)))
    waiting.start()
    buffer.put(make_group(2))
    waiting.join(10)
    assert got and got[0] is not None


def test_actors_are_served_while_learners_wait_for_data(
    server_factory: ServerFactory, settings: BufferSettings, make_group: Groups
) -> None:
    """Long-polling Samples must leave Puts, admission and stats their turn -- not queue them behind
    the Samples' 30 s wait -- however many learners wait (more than a thread pool would have)."""
    server = server_factory(settings)
    waiting = threading.Semaphore(0)
    sample = server.core.sample

    def entered(*args: Any, **kwargs: Any) -> Any:
        waiting.release()  # this Sample is being served
        return sample(*args, **kwargs)

    server.core.sample = entered  # type: ignore[method-assign]
    address = f"127.0.0.1:{server.port}"
    learners = [BufferClient(address, learner_id=f"learner-{i}") for i in range(8)]
    got: list[object] = []
    samplers = [threading.Thread(target=lambda c=c: got.append(c.sample(3, min_groups=3, timeout=30))) for c in learners]
    for thread in samplers:
        thread.start()
    assert all(waiting.acquire(timeout=10) for _ in learners)
    with BufferClient(address, client_id="actor", retry=RetryPolicy(deadline=5.0), timeout=5.0) as actor:
        for _ in range(2):
            assert actor.put(make_group(2)).stored == 2  # each within 5 s, while both Samples wait
        assert actor.acquire(1).granted == 1 and actor.stats().complete_groups == 2
        assert not got  # the learners are still waiting for their third group
        for _ in range(22):
            actor.put(make_group(2))
    for thread in samplers:
        thread.join(30)
    assert len(got) == 8 and all(batch is not None for batch in got)
    for client in learners:
        client.close()


def test_policy_version_and_admission(buffer: BufferClient) -> None:
    load = buffer_pb2.ActorLoad(cpu_cores=0.97, episodes_in_flight=7.8, concurrency=8, trajectories_per_second=23.5)
    credit = buffer.acquire(100, actor_id="actor-3", load=load)
    assert buffer.stats().actor_loads["actor-3"] == load  # the actor's own figures, for stoker.bottleneck
    assert credit.granted == (2 + 0 + 1) * 2 and credit.policy_version == 0
    assert buffer.acquire(1).granted == 0
    buffer.set_policy_version(3)
    credit = buffer.acquire(100)
    assert credit.granted == 6 and credit.policy_version == 3
    buffer.release(6)
    assert buffer.stats().admission_credit == 6


def test_health_and_metrics(server_factory: ServerFactory, settings: BufferSettings, make_group: Groups) -> None:
    server = server_factory(settings, metrics_port=0)
    address = f"127.0.0.1:{server.port}"
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        response = health.Check(health_pb2.HealthCheckRequest(service="stoker.v1.Buffer"), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    with BufferClient(address) as client:
        client.put(make_group(2, actor_id="actor-9"))
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    assert "stoker_buffer_stored_trajectories 2.0" in body
    assert 'stoker_buffer_actor_accepted_trajectories_total{actor="actor-9"} 2.0' in body
    assert "stoker_buffer_put_seconds_count 1.0" in body
    assert 'stoker_buffer_dropped_groups_total{reason="stale"} 0.0' in body


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(server_factory: ServerFactory, settings: BufferSettings, tmp_path: Path, make_group: Groups) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    server = server_factory(settings, tls=TlsFiles(cert, key), token="t")
    with BufferClient(f"localhost:{server.port}", token="t", tls_ca=cert) as client:
        assert client.put(make_group(2)).stored == 2
    with BufferClient(f"localhost:{server.port}", token="t", retry=RetryPolicy(deadline=0.2)) as plaintext:
        with pytest.raises(BufferUnavailableError):
            plaintext.stats()


def test_a_put_whose_caller_gives_up_during_its_flush_is_stored_once(
    server_factory: ServerFactory, settings: BufferSettings, make_group: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once admitted, a Put is finished whatever its caller does: the caller's retry finds it
    stored (a duplicate), so nothing is lost and nothing is stored twice."""
    server = server_factory(settings)
    disk_free = threading.Event()
    real_fdatasync = wal_module.os.fdatasync

    def held_disk(fd: int) -> None:
        assert disk_free.wait(30)
        real_fdatasync(fd)

    monkeypatch.setattr(wal_module.os, "fdatasync", held_disk)
    request = buffer_pb2.PutRequest(client_id="actor", trajectories=[to_proto(e) for e in make_group(2)])
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        put = channel.unary_unary("/stoker.v1.Buffer/Put", request_serializer=bytes, response_deserializer=buffer_pb2.PutResponse.FromString)
        with pytest.raises(grpc.RpcError) as gave_up:
            put(request.SerializeToString(), timeout=0.5)  # its flush cannot finish before the deadline
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    disk_free.set()
    with BufferClient(f"127.0.0.1:{server.port}", client_id="actor") as client:
        retried = client.put_encoded([t.SerializeToString() for t in request.trajectories])[0]
        assert (retried.stored, retried.duplicates) == (0, 2)
        assert client.stats().stored_trajectories == 2 and client.stats().complete_groups == 1


def test_a_failed_flush_is_unavailable_and_the_server_still_stops(
    server_factory: ServerFactory, settings: BufferSettings, make_group: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = server_factory(settings)

    def failing_disk(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(wal_module.os, "fdatasync", failing_disk)
    with BufferClient(f"127.0.0.1:{server.port}", retry=RetryPolicy(deadline=0.2)) as client:
        for _ in range(2):  # the first fails its flush, the next finds the log unusable
            with pytest.raises(BufferUnavailableError, match="UNAVAILABLE"):
                client.put(make_group(2))
        assert client.stats().stored_trajectories == 0
    assert server.core.state.puts_running == 0
    server.stop(grace=0)  # returns: nothing is left waiting for the disk


def test_stopping_with_a_put_mid_flush_finishes_it_and_restart_finds_it_once(
    tmp_path: Path, settings: BufferSettings, make_group: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = BufferServer(settings, tmp_path / "data").start()
    flushing, disk_free = threading.Event(), threading.Event()
    real_fdatasync = wal_module.os.fdatasync

    def held_disk(fd: int) -> None:
        flushing.set()
        assert disk_free.wait(30)
        real_fdatasync(fd)

    monkeypatch.setattr(wal_module.os, "fdatasync", held_disk)
    group = make_group(2)
    outcome: list[object] = []

    def put() -> None:
        with BufferClient(f"127.0.0.1:{server.port}", retry=RetryPolicy(deadline=0.1)) as client:
            try:
                outcome.append(client.put(group))
            except BufferClientError as exc:
                outcome.append(exc)

    writer = threading.Thread(target=put)
    writer.start()
    assert flushing.wait(30)  # the Put is admitted, logged and waiting for its flush
    stopper = threading.Thread(target=server.stop, kwargs={"grace": 0})
    stopper.start()  # cancels the waiting Put's call
    writer.join(30)
    assert outcome and isinstance(outcome[0], BufferClientError)  # not acknowledged...
    disk_free.set()
    stopper.join(30)
    assert not stopper.is_alive(), "stop hung on a Put that was never finished"
    monkeypatch.setattr(wal_module.os, "fdatasync", real_fdatasync)
    again = BufferServer(settings, tmp_path / "data").start()
    try:
        with BufferClient(f"127.0.0.1:{again.port}") as client:
            retried = client.put(group)  # ...so the actor retries: already there, stored once
            assert (retried.stored, retried.duplicates) == (0, 2)
            assert client.stats().stored_trajectories == 2
    finally:
        again.stop(grace=0)
