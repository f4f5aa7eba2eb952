"""Configure over a real loopback server: the settings the buffer takes live (buffer.maxStaleness,
buffer.capacity) change what it enforces at once, without a restart; bad values change nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import grpc
import pytest

from stoker.buffer.client import (
    AuthError,
    BufferClient,
    BufferUnavailableError,
    RetryPolicy,
    SampledBatch,
    decode_sample,
    encode_sample,
)
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import encode_sample_response
from stoker.crd import build_crd
from stoker.spec_learner import MAX_STALENESS
from stoker.trajectory import Episode
from stoker.v1 import buffer_pb2

Groups = Callable[..., list[Episode]]
ServerFactory = Callable[..., BufferServer]
TOKEN = "s3cret"


def client_of(server: BufferServer, **kwargs: object) -> BufferClient:
    client = BufferClient(f"127.0.0.1:{server.port}", token=TOKEN, **kwargs)  # type: ignore[arg-type]
    client.wait_ready(10)
    return client


def test_a_lower_max_staleness_is_enforced_at_once(
    server_factory: ServerFactory, settings: BufferSettings, make_group: Groups
) -> None:
    """settings: maxStaleness 2, batchGroups 2. A group two versions behind is fine under 2; once
    Configure lowers the limit to 1 it is dropped as stale, and admission credit shrinks."""
    with client_of(server_factory(settings, token=TOKEN)) as buffer:
        buffer.put(make_group(2, version=0))
        buffer.set_policy_version(2)
        stats = buffer.stats()
        assert stats.max_staleness == 2 and stats.complete_groups == 1 and not stats.dropped
        # (S + version + 1) * batchGroups - outstanding: (2 + 2 + 1) * 2 - 1 ready group
        assert stats.admission_credit == 9

        buffer.configure(max_staleness=1)
        stats = buffer.stats()
        assert stats.max_staleness == 1
        assert stats.complete_groups == 0 and stats.dropped["stale"] == 1  # 2 behind > 1: dropped now
        assert stats.admission_credit == (1 + 2 + 1) * 2
        assert buffer.sample(1, timeout=0) is None

        buffer.put(make_group(2, version=1))  # 1 behind: within the new limit
        batch = buffer.sample(1, timeout=5)
        assert batch is not None and len(batch.groups) == 1
        assert batch.max_staleness == 1  # the learner drops stale tokens by the buffer's limit
        buffer.commit(batch.batch_id)
        buffer.put(make_group(2, version=1))
        buffer.set_policy_version(3)  # now 2 behind: the new limit drops it on the version change too
        assert buffer.stats().dropped["stale"] == 2


def test_a_sample_response_says_the_limit_even_when_it_is_0() -> None:
    data = encode_sample_response("b", [], 3, max_staleness=0)
    response = buffer_pb2.SampleResponse.FromString(data)
    assert response.HasField("max_staleness") and response.max_staleness == 0
    assert not buffer_pb2.SampleResponse.FromString(encode_sample_response("b", [], 3)).HasField("max_staleness")
    # as a multi-host learner's primary passes the batch on to the other processes
    shared = decode_sample(encode_sample(SampledBatch("b", [], 3, max_staleness=0)))
    assert shared is not None and shared.max_staleness == 0


def test_a_higher_max_staleness_grants_more_credit(server_factory: ServerFactory, settings: BufferSettings) -> None:
    with client_of(server_factory(settings, token=TOKEN)) as buffer:
        assert buffer.acquire(100).granted == (2 + 0 + 1) * 2
        assert buffer.acquire(1).granted == 0
        buffer.configure(max_staleness=5)
        assert buffer.acquire(100).granted == (5 + 0 + 1) * 2 - 6


def test_a_higher_capacity_lets_a_full_buffer_take_puts(
    server_factory: ServerFactory, settings: BufferSettings, make_group: Groups
) -> None:
    server = server_factory(replace(settings, capacity=4, retry_after_seconds=0.01), token=TOKEN)
    with client_of(server, retry=RetryPolicy(initial=0.01, maximum=0.05, deadline=0.3)) as buffer:
        buffer.put(make_group(2) + make_group(2))
        blocked = make_group(2)
        with pytest.raises(BufferUnavailableError, match="RESOURCE_EXHAUSTED"):
            buffer.put(blocked)
        buffer.configure(capacity=6)
        assert buffer.put(blocked).stored == 2
        stats = buffer.stats()
        assert stats.capacity == 6 and stats.stored_trajectories == 6 and stats.fill == 1.0
        buffer.configure(capacity=2)  # lower than what is stored: nothing is lost, Puts wait
        assert buffer.stats().stored_trajectories == 6
        with pytest.raises(BufferUnavailableError, match="RESOURCE_EXHAUSTED"):
            buffer.put(make_group(2))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"capacity": 0}, "capacity: got 0; expected >= 1"),
        ({"capacity": 1 << 41}, "capacity: got 2199023255552; expected 1.."),
        # The spec's own bounds (stoker.spec), applied live too: a complete group must fit...
        ({"capacity": 1}, "capacity: got 1; expected >= group_size (2)"),
        # ...and a staleness limit within buffer.maxStaleness's range (2^32 - 1: a -1 gone through uint32).
        ({"capacity": 10, "max_staleness": 2**32 - 1}, "max_staleness: got 4294967295; expected 0..1000000"),
    ],
)
def test_a_bad_value_is_refused_and_changes_nothing(
    server_factory: ServerFactory, settings: BufferSettings, changes: dict[str, int], message: str
) -> None:
    with client_of(server_factory(settings, token=TOKEN)) as buffer:
        with pytest.raises(grpc.RpcError) as refused:
            buffer.configure(**({"max_staleness": 7} | changes))  # all or nothing: nothing changes
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (refused.value.details() or "") and "Traceback" not in (refused.value.details() or "")
        stats = buffer.stats()
        assert (stats.capacity, stats.max_staleness) == (settings.capacity, settings.max_staleness)


def test_configure_needs_the_token(server_factory: ServerFactory, settings: BufferSettings) -> None:
    server = server_factory(settings, token=TOKEN)
    with BufferClient(f"127.0.0.1:{server.port}", token="wrong") as intruder:
        with pytest.raises(AuthError):
            intruder.configure(max_staleness=100)
    with client_of(server) as buffer:
        assert buffer.stats().max_staleness == settings.max_staleness


def test_the_crd_and_the_buffer_share_the_staleness_bound() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert schema["properties"]["buffer"]["properties"]["maxStaleness"]["maximum"] == MAX_STALENESS
    with pytest.raises(ValueError, match="max_staleness"):
        BufferSettings(max_staleness=MAX_STALENESS + 1)
