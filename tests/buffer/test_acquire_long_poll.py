"""Acquire as a long poll: an actor without credit is answered the moment credit frees up (a new
policy version, a commit, groups dropped or given back), not at its next retry, so actors start
the next groups as soon as the learner moves (issue 50: the retry was ~a quarter of a step)."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from stoker.buffer.client import BufferClient
from stoker.buffer.core import BufferCore
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import encode_trajectory
from stoker.trajectory import Episode
from stoker.v1 import buffer_pb2, buffer_pb2_grpc
from tests.buffer.core_fakes import FakeClock, open_core

Groups = Callable[..., list[Episode]]
# The ``settings`` fixture's allowance at version 0: (max_staleness 2 + 0 + 1) * batch_groups 2.
ALLOWANCE = 6
OPS = ("acquire", "put", "put_stale", "train", "publish", "release", "staleness")


def _one_acquire(address: str, timeout_seconds: float) -> buffer_pb2.AcquireResponse:
    """One Acquire RPC, as sent (the client would ask again on its own)."""
    with grpc.insecure_channel(address) as channel:
        request = buffer_pb2.AcquireRequest(actor_id="waiting", groups=1, timeout_seconds=timeout_seconds)
        response: buffer_pb2.AcquireResponse = buffer_pb2_grpc.BufferStub(channel).Acquire(
            request, timeout=timeout_seconds + 30
        )
        return response


def _waiting_acquires(server: BufferServer) -> int:
    return len(server.service._acquirers._waiting)


@dataclass
class NoCredit:
    """A buffer whose every group of credit an actor holds."""

    server: BufferServer
    address: str
    actor: BufferClient


@pytest.fixture
def no_credit(server_factory: Callable[..., BufferServer], settings: BufferSettings) -> Iterator[NoCredit]:
    server = server_factory(settings)
    address = f"127.0.0.1:{server.port}"
    with BufferClient(address, client_id="actor-0") as actor:
        actor.wait_ready(10)
        assert actor.acquire(ALLOWANCE).granted == ALLOWANCE  # every group the rule allows is taken
        yield NoCredit(server, address, actor)


def test_a_waiting_acquire_is_granted_when_the_learner_publishes(no_credit: NoCredit) -> None:
    answers: list[buffer_pb2.AcquireResponse] = []
    waiting = threading.Thread(target=lambda: answers.append(_one_acquire(no_credit.address, 120.0)))
    waiting.start()
    deadline = time.monotonic() + 30
    while _waiting_acquires(no_credit.server) == 0 and time.monotonic() < deadline:
        waiting.join(0.01)
    assert _waiting_acquires(no_credit.server) == 1 and not answers  # held, not refused
    no_credit.actor.set_policy_version(1)  # the allowance grows by batch_groups
    waiting.join(60)
    assert not waiting.is_alive()
    assert answers[0].granted == 1 and answers[0].policy_version == 1


def test_an_acquire_that_finds_no_credit_waits_its_timeout_then_refuses(no_credit: NoCredit) -> None:
    started = time.monotonic()
    refused = _one_acquire(no_credit.address, 0.3)
    assert refused.granted == 0 and refused.retry_after_seconds > 0
    assert time.monotonic() - started >= 0.3
    assert _one_acquire(no_credit.address, 0.0).granted == 0  # 0: answered at once, as before long polls
    with pytest.raises(grpc.RpcError) as bad:
        _one_acquire(no_credit.address, -1.0)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_client_long_polls_until_credit_comes(no_credit: NoCredit) -> None:
    publisher = threading.Timer(0.2, no_credit.actor.set_policy_version, args=(1,))
    publisher.start()
    try:
        assert no_credit.actor.acquire(1, wait=120).granted == 1
    finally:
        publisher.join()


def _credit_core(path: Path) -> BufferCore:
    settings = BufferSettings(group_size=2, capacity=64, max_staleness=1, batch_groups=2)
    return open_core(path, settings, FakeClock())


@hypothesis_settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=25))
def test_whenever_credit_grows_the_waiting_acquires_are_woken(ops: list[str], make_group: Groups) -> None:
    """The long poll relies on the core calling ``credit_listener`` whenever credit may have
    grown; a missed case would hold an actor until the next housekeeping tick."""
    with tempfile.TemporaryDirectory() as tmp:
        core = _credit_core(Path(tmp))
        wakes = [0]
        core.credit_listener = lambda: wakes.__setitem__(0, wakes[0] + 1)
        held = 0  # credit held by the one actor and not yet used for a group
        for op in ops:
            before, woken = core.state.credit(), wakes[0]
            if op == "acquire":
                held += core.acquire(1, "actor-0")[0]
            elif op in ("put", "put_stale") and held:  # a stale group is dropped as it completes
                version = core.policy_version if op == "put" else max(0, core.policy_version - 2)
                core.put([encode_trajectory(e) for e in make_group(2, version=version)], "actor-0")
                held -= 1
            elif op == "train":
                batch = core.sample(2, 1)
                if batch is not None:
                    core.commit(batch.batch_id)
            elif op == "publish":
                core.set_policy_version(core.policy_version + 1)
            elif op == "release" and held:
                core.release(1, "actor-0")
                held -= 1
            elif op == "staleness":
                core.configure(max_staleness=0 if core.settings.max_staleness else 1)
            if core.state.credit() > before:
                assert wakes[0] > woken, f"{op} freed credit ({before} -> {core.state.credit()}) without a wake"
        core.close()
