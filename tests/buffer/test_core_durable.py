"""The buffer's state machine without gRPC, part two: retries and restarts, leases, timeouts,
compaction, a damaged log, message sizes, concurrent Puts and loads."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

import stoker.buffer.wal as wal_module
from stoker.buffer.core import LOAD_SECONDS
from stoker.buffer.core_state import CONSUME
from stoker.buffer.settings import BufferSettings
from stoker.buffer.state import CODE_INVALID_ARGUMENT, CODE_OK, Unavailable, UnknownBatch
from stoker.buffer.wire import encode_trajectory
from stoker.trajectory import Episode
from stoker.v1 import buffer_pb2, trajectory_pb2
from tests.buffer.core_fakes import FakeClock, open_core, put, sampled_ids

FAILED = trajectory_pb2.EPISODE_STATUS_FAILED
TIMEOUT = trajectory_pb2.EPISODE_STATUS_TIMEOUT
Groups = Callable[..., list[Episode]]


def test_retried_put_is_stored_once_even_across_restart_and_consumption(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    core = open_core(tmp_path, settings)
    group = make_group(2)
    raws = [encode_trajectory(e) for e in group]
    assert core.put(raws).stored == 2
    again = core.put(raws)
    assert (again.stored, again.duplicates) == (0, 2)
    batch_id, _ = sampled_ids(core)
    core.commit(batch_id)
    core.close()
    core = open_core(tmp_path, settings)
    late = core.put(raws)  # a very late retry, after the group was trained on and the buffer restarted
    assert (late.stored, late.duplicates) == (0, 2)
    assert core.sample(1, 1, 0) is None


def test_a_retry_after_its_group_was_consumed_and_its_segment_deleted_is_a_duplicate_after_restart(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    # Put; restart; consume; the Put's segment is deleted; restart; retry: the retry must count as
    # a duplicate, not as an invalid episode of a consumed group (issue 25, defect 1).
    core = open_core(tmp_path, settings)
    raws = [encode_trajectory(e) for e in make_group(2)]
    assert core.put(raws).stored == 2
    core.close()
    core = open_core(tmp_path, settings)
    first_segment = min(core.wal.segments)
    batch_id, _ = sampled_ids(core)
    core.commit(batch_id)
    core.compact()
    assert first_segment not in core.wal.segments  # the Put records are gone from disk
    core.close()
    core = open_core(tmp_path, settings)
    retry = core.put(raws)
    assert retry.results == [(CODE_OK, "", "")] * 2
    assert (retry.stored, retry.duplicates) == (0, 2)
    assert core.sample(1, 1, 0) is None


def test_group_consistency_is_enforced(tmp_path: Path, make_episode: Callable[..., Episode]) -> None:
    core = open_core(tmp_path, BufferSettings(group_size=0, capacity=64))
    put(core, [make_episode("g", group_size=2)])
    mismatch = put(core, [make_episode("g", group_size=3)])
    assert mismatch[0][:2] == (CODE_INVALID_ARGUMENT, "group_size")
    put(core, [make_episode("g", group_size=2)])
    extra = put(core, [make_episode("g", group_size=2)])  # a third episode of a complete group of 2
    assert extra[0][:2] == (CODE_INVALID_ARGUMENT, "group_id")


def test_restart_replays_every_unconsumed_trajectory_once(
    tmp_path: Path, settings: BufferSettings, make_group: Groups, make_episode: Callable[..., Episode]
) -> None:
    core = open_core(tmp_path, settings)
    committed, leased, waiting = make_group(2), make_group(2), make_group(2)
    half = make_episode("g-half")
    for group in (committed, leased, waiting):
        put(core, group)
    put(core, [half])
    batch_id, _ = sampled_ids(core, 1)
    core.commit(batch_id)
    sampled_ids(core, 1)  # leased, never committed
    core.set_policy_version(1)
    core.close()

    core = open_core(tmp_path, settings)
    stats = core.stats()
    assert stats.replayed_trajectories == 5 and stats.policy_version == 1
    assert stats.committed_groups_total == 1 and stats.incomplete_groups == 1
    _, groups = sampled_ids(core)
    assert groups == [[e.episode_id for e in leased], [e.episode_id for e in waiting]]
    put(core, [make_episode("g-half")])
    _, groups = sampled_ids(core)
    assert groups[0][0] == half.episode_id


def test_uncommitted_batch_is_redelivered_when_its_learner_restarts(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    core = open_core(tmp_path, settings)
    first, second = make_group(2), make_group(2)
    put(core, first)
    put(core, second)
    lost = core.sample(1, 1, 0, learner_id="learner", session_id="run-1")
    assert lost is not None
    again = core.sample(2, 1, 0, learner_id="learner", session_id="run-2")  # the learner restarted
    assert again is not None and [g for g, _, _ in again.groups] == [first[0].group_id, second[0].group_id]
    with pytest.raises(UnknownBatch):
        core.commit(lost.batch_id)
    assert core.stats().redelivered_groups == 1
    assert core.commit(again.batch_id) == 4
    assert core.stats().fill == 0  # the lost lease no longer counts as held by the learner


def test_expired_lease_is_redelivered(tmp_path: Path, settings: BufferSettings, make_group: Groups) -> None:
    clock = FakeClock()
    core = open_core(tmp_path, replace(settings, lease_timeout_seconds=30), clock)
    put(core, make_group(2))
    assert core.sample(1, 1, 0, learner_id="learner") is not None
    clock.now += 29
    core.tick()
    assert core.sample(1, 1, 0) is None
    clock.now += 2
    core.tick()
    assert core.sample(1, 1, 0) is not None


def test_incomplete_group_past_its_timeout_is_reported(
    tmp_path: Path, settings: BufferSettings, make_episode: Callable[..., Episode], caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    core = open_core(tmp_path, replace(settings, group_timeout_seconds=60), clock)
    put(core, [make_episode("g-slow")])
    assert core.stats().stale_incomplete_groups == 0
    clock.now += 61
    with caplog.at_level(logging.WARNING, logger="stoker.buffer"):
        core.tick()
    assert core.stats().stale_incomplete_groups == 1
    assert "g-slow" in caplog.text and "1 of 2 episodes" in caplog.text


def test_log_stays_bounded_and_survives_compaction(
    tmp_path: Path, settings: BufferSettings, make_group: Groups, make_episode: Callable[..., Episode]
) -> None:
    small = replace(settings, segment_bytes=8192, capacity=1000)
    core = open_core(tmp_path, small)
    pinned = make_episode("g-never-complete", tokens=64)
    put(core, [pinned])  # pins the first segment until copied forward
    for _ in range(60):
        put(core, make_group(2, tokens=64))
        batch_id, _ = sampled_ids(core)
        core.commit(batch_id)
        core.compact()
    stats = core.stats()
    assert stats.log_segments <= 4
    assert stats.log_bytes <= 2 * 2 * 8192 + 2 * 8192 + 8192
    core.close()
    core = open_core(tmp_path, small)  # what survived compaction is exactly the live trajectory
    assert core.stats().stored_trajectories == 1
    put(core, [make_episode("g-never-complete", tokens=64)])
    _, groups = sampled_ids(core)
    assert groups[0][0] == pinned.episode_id


def test_damaged_log_tail_is_skipped_and_counted(
    tmp_path: Path, settings: BufferSettings, make_group: Groups, caplog: pytest.LogCaptureFixture
) -> None:
    core = open_core(tmp_path, settings)
    kept, torn = make_group(2), make_group(2)
    put(core, kept)
    put(core, torn)
    core.close()
    segment = sorted(tmp_path.glob("*.wal"))[-1]
    data = segment.read_bytes()
    segment.write_bytes(data[:-20])  # a crash in the middle of the last record
    with caplog.at_level(logging.WARNING):
        core = open_core(tmp_path, settings)
    assert core.stats().corrupt_log_tails == 1
    assert core.stats().complete_groups == 1 and core.stats().incomplete_groups == 1
    assert "truncated record" in caplog.text


def test_a_sampled_batch_stays_under_the_message_size_limit(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    core = open_core(tmp_path, replace(settings, max_message_bytes=64 * 1024 + 30_000))
    for _ in range(3):
        put(core, make_group(2, tokens=1000))  # ~13 KB per trajectory, ~26 KB per group
    sizes = []
    while (batch := core.sample(3, 1, 0)) is not None:
        sizes.append(len(batch.groups))
    assert sizes == [1, 1, 1]


def test_a_record_that_does_not_parse_is_skipped_at_startup(
    tmp_path: Path, settings: BufferSettings, make_group: Groups, caplog: pytest.LogCaptureFixture
) -> None:
    core = open_core(tmp_path, settings)
    group = make_group(2)
    put(core, group)
    core.wal.sync(core.wal.append(CONSUME, [b"\xff\xff not a LogConsume"]))  # e.g. written by a newer version
    core.close()
    with caplog.at_level(logging.WARNING):
        core = open_core(tmp_path, settings)
    assert "unreadable record" in caplog.text
    _, groups = sampled_ids(core)
    assert groups == [[e.episode_id for e in group]]


def test_concurrent_overlapping_puts_store_each_episode_once(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    import threading

    core = open_core(tmp_path, replace(settings, capacity=1000))
    groups = [make_group(2) for _ in range(40)]
    raws = [encode_trajectory(e) for g in groups for e in g]
    start = threading.Barrier(6)
    outcomes = []

    def client(offset: int) -> None:
        start.wait()
        for i in range(0, len(raws), 4):  # every client sends everything, in a different order
            chunk = raws[(i + offset * 4) % len(raws) : (i + offset * 4) % len(raws) + 4]
            outcomes.append(core.put(chunk))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(o.stored for o in outcomes) == len(raws)
    assert sum(o.stored + o.duplicates for o in outcomes) == 6 * len(raws)
    delivered: list[str] = []
    while (batch := core.sample(100, 1, 0)) is not None:
        delivered += [trajectory_pb2.Trajectory.FromString(bytes(r)).episode_id for _, rs, _ in batch.groups for r in rs]
    assert sorted(delivered) == sorted(e.episode_id for g in groups for e in g)


def test_a_put_whose_flush_fails_is_refused_and_leaves_nothing_behind(
    tmp_path: Path, settings: BufferSettings, make_group: Groups, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = open_core(tmp_path, settings)
    group = make_group(2)

    def failing_disk(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(wal_module.os, "fdatasync", failing_disk)
    with pytest.raises(Unavailable, match="flush failed"):
        put(core, group)
    # Not stored, not pending: the episodes are neither sampleable nor taken for duplicates, and
    # the log refuses further writes rather than acknowledge anything after a failed flush.
    stats = core.stats()
    assert stats.stored_trajectories == 0 and stats.complete_groups == 0
    with pytest.raises(Unavailable, match="unusable"):
        put(core, group)
    assert not core.state.pending_ids and not core.state.pending_groups and core.state.puts_running == 0
    core.close()  # returns: no Put is left running


def test_a_waiting_sample_returns_as_soon_as_enough_groups_are_complete(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    import threading

    core = open_core(tmp_path, settings)
    result: list[object] = []
    waiting = threading.Thread(target=lambda: result.append(core.sample(3, 3, timeout=30)))
    waiting.start()
    for _ in range(3):
        put(core, make_group(2))
    waiting.join(timeout=30)
    assert not waiting.is_alive(), "the Sample was not woken when its third group completed"
    batch = result[0]
    assert batch is not None and len(batch.groups) == 3  # type: ignore[attr-defined]
    core.close()



def test_each_actors_newest_load_is_in_stats_until_it_stops_reporting(tmp_path: Path, settings: BufferSettings) -> None:
    clock = FakeClock()
    core = open_core(tmp_path, settings, clock)
    core.acquire(1, "actor-0", buffer_pb2.ActorLoad(cpu_cores=0.5, episodes_in_flight=3.0, concurrency=8))
    core.acquire(1, "actor-0", buffer_pb2.ActorLoad(cpu_cores=0.9, episodes_in_flight=7.5, concurrency=8))
    core.acquire(1, "actor-1")  # an actor too old to report a load
    assert dict(core.stats().actor_loads) == {
        "actor-0": buffer_pb2.ActorLoad(cpu_cores=0.9, episodes_in_flight=7.5, concurrency=8)
    }
    clock.now += LOAD_SECONDS + 1  # actor-0 stopped asking for credit
    assert dict(core.stats().actor_loads) == {}
