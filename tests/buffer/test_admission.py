"""Admission credit when the learner consumes batches without updating (nothing to learn from)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stoker.buffer.core import BufferCore
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import encode_trajectory
from stoker.trajectory import Episode


def test_batches_consumed_without_an_update_do_not_use_up_credit(
    tmp_path: Path, settings: BufferSettings, make_group: Callable[..., list[Episode]]
) -> None:
    # max_staleness 2, batch_groups 2: (2 + version + 1) * 2 groups minus those the updates consumed.
    core = BufferCore(settings, tmp_path)
    core.open()

    def consume_one_batch() -> None:
        assert core.acquire(2)[0] == 2
        core.put([encode_trajectory(e) for g in (make_group(2), make_group(2)) for e in g])
        batch = core.sample(2, 2, 0)
        assert batch is not None
        core.commit(batch.batch_id)

    assert core.stats().admission_credit == 6
    consume_one_batch()
    core.set_policy_version(1)  # the learner trained on it
    assert core.stats().admission_credit == 6
    # Three batches consumed without an update (every group solved alike: no reward spread), so
    # the version stays at 1. Counting them would take the credit to 0 after the third: actors
    # idle, and the learner waiting for data at the same version, forever.
    for _ in range(3):
        consume_one_batch()
    assert core.stats().admission_credit == 6
    consume_one_batch()
    core.set_policy_version(2)
    assert core.stats().admission_credit == 6
