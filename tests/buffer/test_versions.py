"""Policy version rules: at least 0, never backwards, bounded so no admission arithmetic
overflows; a bad value is INVALID_ARGUMENT and leaves Stats and /metrics working (issue 25, defect 3)."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from stoker.buffer.client import BufferClient
from stoker.buffer.core import BufferCore
from stoker.buffer.core_state import VERSION
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.v1 import buffer_pb2

ServerFactory = Callable[..., BufferServer]


@pytest.mark.parametrize("version", [-1, -(1 << 63), 1 << 61, (1 << 63) - 1])
def test_an_out_of_range_version_is_invalid_and_stats_and_metrics_still_answer(
    server_factory: ServerFactory, settings: BufferSettings, version: int
) -> None:
    server = server_factory(settings, metrics_port=0)
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.set_policy_version(3)
        with pytest.raises(grpc.RpcError) as refused:
            client.set_policy_version(version)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "policy_version" in (refused.value.details() or "")
        assert client.stats().policy_version == 3
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
    assert metrics.status == 200 and b"stoker_buffer_policy_version 3.0" in metrics.read()


def test_a_version_never_goes_backwards_but_may_be_repeated(buffer: BufferClient) -> None:
    buffer.set_policy_version(5)
    buffer.set_policy_version(5, duty_cycle=0.5)  # an idle learner repeats its version
    with pytest.raises(grpc.RpcError) as refused:
        buffer.set_policy_version(4)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "backwards" in (refused.value.details() or "")
    buffer.set_policy_version(6)
    assert buffer.stats().policy_version == 6


def test_an_out_of_range_version_already_in_the_log_is_skipped_at_restart(tmp_path: Path, settings: BufferSettings) -> None:
    core = BufferCore(settings, tmp_path)
    core.open()
    core.set_policy_version(7)
    # As an older buffer logged it, before versions were checked.
    core.wal.append(VERSION, [buffer_pb2.LogPolicyVersion(policy_version=1 << 61).SerializeToString()])
    core.close()
    restarted = BufferCore(settings, tmp_path)
    restarted.open()
    stats = restarted.stats()
    assert stats.policy_version == 7 and stats.admission_credit > 0
    stats.SerializeToString()  # every field in range
    restarted.close()
