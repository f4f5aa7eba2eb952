"""Admission credit is held per actor process (``CreditLedger``): a dead actor's credit comes back
when its actor returns as a new process or stays silent past ``group_timeout_seconds``, so actor
deaths do not starve the run (issue 53)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from stoker.buffer.admission import CreditLedger
from stoker.buffer.client import BufferClient
from stoker.buffer.core import BufferCore
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import encode_trajectory
from stoker.trajectory import Episode
from tests.buffer.core_fakes import FakeClock, open_core

Groups = Callable[..., list[Episode]]
# The ``settings`` fixture's allowance: (max_staleness 2 + version 0 + 1) * batch_groups 2.
ALLOWANCE = 6


def put(core: BufferCore, episodes: list[Episode], incarnation: str) -> None:
    core.put([encode_trajectory(e) for e in episodes], "actor-0", incarnation)


def test_a_restarted_actor_gets_back_the_credit_its_dead_process_held(tmp_path: Path, settings: BufferSettings) -> None:
    core = open_core(tmp_path, settings, FakeClock())
    assert core.acquire(ALLOWANCE, "actor-0", incarnation="first")[0] == ALLOWANCE
    # Another actor's new process takes nothing back: actor-0's first process may still be running.
    assert core.acquire(1, "actor-1", incarnation="other")[0] == 0
    # actor-0 again under a new process: the first one is dead, its groups will never arrive.
    assert core.acquire(ALLOWANCE, "actor-0", incarnation="second")[0] == ALLOWANCE
    assert core.stats().in_flight_groups == ALLOWANCE and core.stats().admission_credit == 0


def test_a_superseded_process_s_late_group_does_not_give_back_the_new_one_s_credit(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    core = open_core(tmp_path, settings, FakeClock())
    core.acquire(2, "actor-0", incarnation="first")
    core.acquire(3, "actor-0", incarnation="second")
    put(core, make_group(2), "first")  # its credit went back at the restart already
    assert core.stats().in_flight_groups == 3
    put(core, make_group(2), "second")
    assert core.stats().in_flight_groups == 2


def test_the_credit_of_an_actor_silent_past_the_group_timeout_comes_back(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    clock = FakeClock()
    core = open_core(tmp_path, replace(settings, group_timeout_seconds=60.0), clock)
    core.acquire(2, "actor-0", incarnation="gone")
    core.acquire(2, "actor-1", incarnation="busy")
    clock.now += 40
    put(core, make_group(2)[:1], "busy")  # a Put is a sign of life, even of half a group
    clock.now += 40
    core.tick()
    # 80 s of silence from actor-0's process: expired; actor-1's Put was 40 s ago: kept.
    assert core.stats().in_flight_groups == 2
    clock.now += 30
    core.tick()
    assert core.stats().in_flight_groups == 0
    assert core.stats().admission_credit == ALLOWANCE


def test_calls_without_an_incarnation_share_one_hold_as_before() -> None:
    ledger = CreditLedger()
    ledger.register("actor-0", "", 0.0)
    ledger.grant("", 3, 0.0)
    ledger.register("actor-0", "", 1.0)  # no incarnation: no restart can be told, nothing is given back
    assert ledger.total == 3
    assert ledger.expire(1e9, 60.0) == []  # and it never expires
    ledger.give_back("", 5, 2.0)  # never below zero
    assert ledger.total == 0


def test_over_grpc_each_client_is_a_process_and_its_puts_use_its_own_credit(
    server_factory: Callable[..., BufferServer], settings: BufferSettings, make_group: Groups
) -> None:
    server = server_factory(settings)
    address = f"127.0.0.1:{server.port}"
    with BufferClient(address, client_id="actor-0") as first:
        first.wait_ready(10)
        assert first.acquire(ALLOWANCE).granted == ALLOWANCE
        assert first.acquire(1).granted == 0
    # The same actor id from a new client (a restarted process) has the whole allowance again.
    with BufferClient(address, client_id="actor-0") as second:
        assert second.acquire(1).granted == 1
        with second.put_stream() as stream:  # the stream, like the unary calls, names its process
            for episode in make_group(2):
                stream.put(episode)
        assert second.stats().in_flight_groups == 0
        second.acquire(2)
        second.release(1)
        assert second.stats().in_flight_groups == 1
