"""The buffer's state machine without gRPC, part one: groups, masking, staleness, admission and
capacity (part two, test_core_durable.py: restarts, leases, compaction)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from stoker.buffer.settings import BufferSettings
from stoker.buffer.state import CODE_OK, BufferFull
from stoker.trajectory import Episode
from stoker.v1 import trajectory_pb2
from tests.buffer.core_fakes import open_core, put, sampled_ids

FAILED = trajectory_pb2.EPISODE_STATUS_FAILED
TIMEOUT = trajectory_pb2.EPISODE_STATUS_TIMEOUT
Groups = Callable[..., list[Episode]]


def test_a_group_is_sampleable_only_when_complete(tmp_path: Path, settings: BufferSettings, make_group: Groups) -> None:
    core = open_core(tmp_path, settings)
    first, second = make_group(2)
    put(core, [first])
    assert core.sample(1, 1, 0) is None
    assert core.stats().incomplete_groups == 1
    put(core, [second])
    batch_id, groups = sampled_ids(core)
    assert groups == [[first.episode_id, second.episode_id]]
    assert core.commit(batch_id) == 2
    assert core.stats().stored_trajectories == 0


def test_groups_are_delivered_fifo_and_once(tmp_path: Path, settings: BufferSettings, make_group: Groups) -> None:
    core = open_core(tmp_path, settings)
    groups = [make_group(2) for _ in range(3)]
    for group in groups:
        put(core, group)
    _, first = sampled_ids(core, 2)
    _, second = sampled_ids(core, 2)
    assert first + second == [[e.episode_id for e in g] for g in groups]
    assert core.sample(1, 1, 0) is None


def test_newest_first_delivers_the_latest_completed_groups_and_lets_the_backlog_age_out(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    core = open_core(tmp_path, replace(settings, sample_order="newest-first"))  # max_staleness = 2
    oldest, middle, newest = (make_group(2, version=v) for v in (0, 1, 1))
    for group in (oldest, middle, newest):
        put(core, group)
    _, first = sampled_ids(core, 2)
    assert first == [[e.episode_id for e in newest], [e.episode_id for e in middle]]
    core.set_policy_version(3)  # the backlog's group is now 3 versions behind: dropped, not delivered
    assert core.sample(1, 1, 0) is None
    assert core.stats().dropped["stale"] == 1


def test_newest_first_redelivers_a_lost_batch_next(tmp_path: Path, settings: BufferSettings, make_group: Groups) -> None:
    core = open_core(tmp_path, replace(settings, sample_order="newest-first"))
    groups = [make_group(2) for _ in range(3)]
    for group in groups:
        put(core, group)
    lost = core.sample(2, 1, 0, learner_id="learner", session_id="run-1")
    assert lost is not None
    again = core.sample(2, 1, 0, learner_id="learner", session_id="run-2")  # the learner restarted
    assert again is not None and [g for g, _, _ in again.groups] == [g for g, _, _ in lost.groups]
    _, rest = sampled_ids(core)
    assert rest == [[e.episode_id for e in groups[0]]]


def test_group_with_a_failed_episode_is_delivered_masked_by_default(
    tmp_path: Path, settings: BufferSettings, make_group: Groups, make_episode: Callable[..., Episode]
) -> None:
    core = open_core(tmp_path, settings)
    ok = make_episode("g-mixed")
    failed = make_episode("g-mixed", status=TIMEOUT)
    put(core, [ok, failed])
    batch = core.sample(1, 1, 0)
    assert batch is not None and batch.groups[0][2] is True  # masked
    assert core.stats().masked_groups_delivered == 1


def test_discard_policy_drops_and_counts_groups_with_a_failure(
    tmp_path: Path, settings: BufferSettings, make_episode: Callable[..., Episode]
) -> None:
    core = open_core(tmp_path, replace(settings, failed_group_policy="discard"))
    put(core, [make_episode("g1"), make_episode("g1", status=FAILED)])
    assert core.sample(1, 1, 0) is None
    assert core.stats().dropped["failed"] == 1
    assert core.stats().stored_trajectories == 0


def test_group_of_only_failed_episodes_is_dropped_whatever_the_policy(
    tmp_path: Path, settings: BufferSettings, make_episode: Callable[..., Episode]
) -> None:
    core = open_core(tmp_path, settings)
    put(core, [make_episode("g1", status=FAILED), make_episode("g1", status=TIMEOUT)])
    assert core.sample(1, 1, 0) is None
    assert core.stats().dropped["failed"] == 1


def test_stale_groups_are_dropped_at_sample_time(tmp_path: Path, settings: BufferSettings, make_group: Groups) -> None:
    core = open_core(tmp_path, settings)  # max_staleness = 2
    old, fresh = make_group(2, version=1), make_group(2, version=3)
    put(core, old)
    put(core, fresh)
    core.set_policy_version(4)  # old is 3 versions behind: stale; fresh is 1 behind
    _, groups = sampled_ids(core)
    assert groups == [[e.episode_id for e in fresh]]
    stats = core.stats()
    assert stats.dropped["stale"] == 1
    assert dict(stats.staleness_histogram) == {1: 1}


def test_a_group_already_stale_on_arrival_is_dropped(tmp_path: Path, settings: BufferSettings, make_group: Groups) -> None:
    core = open_core(tmp_path, settings)
    core.set_policy_version(10)
    put(core, make_group(2, version=7))
    assert core.sample(1, 1, 0) is None
    assert core.stats().dropped["stale"] == 1


def test_admission_credit_follows_the_areal_rule(tmp_path: Path, settings: BufferSettings, make_group: Groups) -> None:
    # credit = (max_staleness + version + 1) * batch_groups - (accepted + in_flight) = (2 + 0 + 1) * 2 = 6
    core = open_core(tmp_path, settings)
    assert core.acquire(4) == (4, 0, 0.0)
    granted, _, retry = core.acquire(4)
    assert granted == 2  # only 6 - 4 left
    assert core.acquire(1)[0] == 0 and core.acquire(1)[2] > 0  # a retry hint when nothing is granted
    put(core, make_group(2))  # a granted group arrives: in flight -> accepted, credit unchanged
    assert core.stats().admission_credit == 0 and core.stats().in_flight_groups == 5
    core.release(2)  # two groups will never be started
    assert core.stats().admission_credit == 2
    core.set_policy_version(1)  # each new version admits batch_groups more
    assert core.stats().admission_credit == 4


def test_dropped_groups_give_their_credit_back(tmp_path: Path, settings: BufferSettings, make_group: Groups) -> None:
    core = open_core(tmp_path, settings)
    assert core.acquire(6)[0] == 6
    put(core, make_group(2, version=0))
    core.set_policy_version(3)  # the group is now stale and dropped: its work must be redone
    assert core.stats().dropped["stale"] == 1
    assert core.stats().admission_credit == (2 + 3 + 1) * 2 - 5


def test_full_buffer_refuses_the_whole_batch_and_evicts_nothing(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    core = open_core(tmp_path, replace(settings, capacity=4))
    put(core, make_group(2))
    put(core, make_group(2))
    blocked = make_group(2)
    with pytest.raises(BufferFull) as full:
        put(core, blocked)
    assert full.value.retry_after > 0
    assert core.stats().stored_trajectories == 4 and core.stats().full_rejections == 1
    batch_id, _ = sampled_ids(core, 1)
    core.commit(batch_id)
    assert put(core, blocked) == [(CODE_OK, "", "")] * 2


def test_leased_batches_leave_room_for_the_actors_up_to_a_second_capacity(
    tmp_path: Path, settings: BufferSettings, make_group: Groups
) -> None:
    core = open_core(tmp_path, replace(settings, capacity=4))
    put(core, make_group(2))
    put(core, make_group(2))
    with pytest.raises(BufferFull):
        put(core, make_group(2))
    first, _ = sampled_ids(core, 1)  # the learner's working set no longer throttles the actors
    assert core.stats().fill == 0.5
    put(core, make_group(2))
    with pytest.raises(BufferFull, match="4 of 4 trajectories waiting, 2 more leased"):
        put(core, make_group(2))
    sampled_ids(core, 2)
    put(core, make_group(2))
    with pytest.raises(BufferFull):  # only 2 waiting, but 6 leased: memory stays within 2 x capacity
        put(core, make_group(2))
    assert core.stats().stored_trajectories == 8
    core.commit(first)
    put(core, make_group(2))
