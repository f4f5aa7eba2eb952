"""Bad input to every RPC: random bytes and mutated valid messages get a clear status code, never
UNKNOWN or INTERNAL, and never a traceback in the server's log (issue 25, defect 4); plus the
smaller cases the issue lists: bounded messages, turn rewards per token, unknown statuses."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from stoker.buffer.client import BufferClient, InvalidTrajectoryError
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import encode_put_request, encode_trajectory
from stoker.trajectory import Episode, to_proto
from stoker.v1 import buffer_pb2

ServerFactory = Callable[..., BufferServer]
Groups = Callable[..., list[Episode]]

ANSWERS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a mutated Sample that asks to wait longer than the test's deadline
}


def valid_requests(make_group: Groups) -> dict[str, bytes]:
    return {
        "Put": encode_put_request("fuzz", [encode_trajectory(e) for e in make_group(2)]),
        "Acquire": buffer_pb2.AcquireRequest(actor_id="actor", groups=1).SerializeToString(),
        "Release": buffer_pb2.ReleaseRequest(actor_id="actor", groups=1).SerializeToString(),
        "Sample": buffer_pb2.SampleRequest(learner_id="l", session_id="s", max_groups=2, min_groups=1).SerializeToString(),
        "Commit": buffer_pb2.CommitRequest(batch_id="0" * 32).SerializeToString(),
        "SetPolicyVersion": buffer_pb2.SetPolicyVersionRequest(policy_version=1, learner_duty_cycle=0.5).SerializeToString(),
        "Stats": buffer_pb2.StatsRequest().SerializeToString(),
    }


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        action = rng.randrange(4)
        if action == 0 and buf:  # flip a byte
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif action == 1 and buf:  # cut
            del buf[rng.randrange(len(buf)) :]
        elif action == 2:  # insert random bytes
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = rng.randbytes(rng.randint(1, 12))
        elif buf:  # set a byte to an extreme
            buf[rng.randrange(len(buf))] = rng.choice((0x00, 0x7F, 0x80, 0xFF))
    return bytes(buf)


def test_random_and_mutated_requests_to_every_rpc_get_clear_codes_and_no_traceback(
    server_factory: ServerFactory, settings: BufferSettings, make_group: Groups, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server = server_factory(settings)
    rng = random.Random(25)
    codes: dict[str, set[grpc.StatusCode]] = {}
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for method, valid in valid_requests(make_group).items():
            call = channel.unary_unary(f"/stoker.v1.Buffer/{method}")
            cases = [rng.randbytes(rng.randint(1, 64)) for _ in range(15)] + [mutate(rng, valid) for _ in range(25)]
            for request in cases:
                try:
                    call(request, timeout=0.5 if method == "Sample" else 5)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
                    assert len(exc.details() or "") <= 400, (method, exc.details())
                assert code in ANSWERS, (method, request, code)
                codes.setdefault(method, set()).add(code)
    assert all(grpc.StatusCode.INVALID_ARGUMENT in seen for seen in codes.values()), codes  # every method refused some
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks[:3]]
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        assert client.stats().capacity == settings.capacity  # still serving


def test_a_malformed_request_is_invalid_argument_with_one_log_line(
    server_factory: ServerFactory, settings: BufferSettings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server = server_factory(settings)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for method in ("Acquire", "Release", "Sample", "Commit", "SetPolicyVersion", "Stats"):
            caplog.clear()
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary(f"/stoker.v1.Buffer/{method}")(b"\xff\xff\xff", timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "malformed" in (refused.value.details() or "")
            lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(lines) == 1 and lines[0].exc_info is None, (method, [r.getMessage() for r in lines])


def test_commit_of_an_unknown_batch_does_not_echo_an_unbounded_id(buffer: BufferClient) -> None:
    call = buffer.channel.unary_unary("/stoker.v1.Buffer/Commit")
    with pytest.raises(grpc.RpcError) as huge:
        call(buffer_pb2.CommitRequest(batch_id="x" * 100_000).SerializeToString(), timeout=5)
    assert huge.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(huge.value.details() or "") < 400
    with pytest.raises(grpc.RpcError) as unknown:
        call(buffer_pb2.CommitRequest(batch_id="y" * 120).SerializeToString(), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and len(unknown.value.details() or "") < 400


def test_more_turn_rewards_than_tokens_and_unknown_statuses_are_refused(buffer: BufferClient, make_group: Groups) -> None:
    too_many, unknown_status = make_group(2, tokens=4)
    message = to_proto(too_many)
    message.turn_rewards.extend([0.0] * 5)  # 5 rewards for 4 tokens
    odd = to_proto(unknown_status)
    odd.status = 99  # type: ignore[assignment]
    with pytest.raises(InvalidTrajectoryError) as refused:
        buffer.put([message, odd])
    assert refused.value.fields == ["turn_rewards", "status"]


def test_a_ready_file_that_cannot_be_written_is_one_clear_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    ready = tmp_path / "missing-directory" / "ready"
    done = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "buffer", "--port", "0", "--host", "127.0.0.1", "--data-dir", str(tmp_path / "d"),
         "--ready-file", str(ready), "--log-format", "text"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--ready-file" in done.stderr and "cannot write" in done.stderr and "Traceback" not in done.stderr


def test_a_put_with_many_invalid_trajectories_still_reports_each_by_field(
    buffer: BufferClient, make_episode: Callable[..., Episode]
) -> None:
    group = "g" * 250  # each refusal names the group: 64 of them are more than gRPC's 8 KiB of metadata
    buffer.put([make_episode(group, group_size=2) for _ in range(2)])
    with pytest.raises(InvalidTrajectoryError) as refused:
        buffer.put([make_episode(group, group_size=2) for _ in range(64)])
    assert refused.value.fields == ["group_id"] * 64


def test_malformed_health_checks_are_invalid_argument_without_a_traceback(
    server_factory: ServerFactory, settings: BufferSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """Kubernetes and load balancers probe grpc.health.v1.Health, so anyone reaching the port can
    send it anything: 150 random payloads get OK, NOT_FOUND or INVALID_ARGUMENT, a rate-limited
    log line at most each, no traceback; real probes still answer."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    caplog.set_level(logging.DEBUG)
    server = server_factory(settings)
    rng = random.Random(35)
    valid = health_pb2.HealthCheckRequest(service="stoker.v1.Buffer").SerializeToString()
    codes: set[grpc.StatusCode] = set()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        for request in [rng.randbytes(rng.randint(1, 64)) for _ in range(75)] + [mutate(rng, valid) for _ in range(75)]:
            try:
                check(request, timeout=5)
                codes.add(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.add(exc.code())
                assert len(exc.details() or "") <= 400
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(watch(b"\xff\xff\xff", timeout=5)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest(service="stoker.v1.Buffer"), timeout=5).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        first = next(iter(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)))
        assert first.status == health_pb2.HealthCheckResponse.SERVING
    assert grpc.StatusCode.INVALID_ARGUMENT in codes and codes <= {
        grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}, codes
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks[:3]]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "Health" in r.getMessage()]
    assert len(warnings) <= 20, len(warnings)  # rate-limited (10 a second), not one per request
