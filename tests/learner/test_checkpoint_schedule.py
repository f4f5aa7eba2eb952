"""A learner killed at any moment trains at most ``checkpoint.intervalSteps`` steps again."""

from __future__ import annotations

import pytest

from stoker.learner.checkpoint_schedule import CheckpointSchedule


def simulate(interval: int, write_steps: int, steps: int) -> tuple[int, int, int]:
    """A learner whose saves take ``write_steps`` steps to be durable: (the most steps ever past the
    newest durable checkpoint, the saves made, the steps it waited before)."""
    schedule, writing_until = CheckpointSchedule(interval), None
    at_risk = saves = waits = 0
    for step in range(steps):  # ``step`` trained so far
        schedule.observe(step, in_progress=writing_until is not None and step < writing_until)
        if schedule.must_wait(step + 1):
            waits += 1
            if schedule.saving is None:
                schedule.started(step)
                saves += 1
            schedule.waited(step)
            writing_until = None
        at_risk = max(at_risk, step + 1 - schedule.durable)  # the next step trained, then killed
        schedule.observe(step + 1, in_progress=writing_until is not None and step + 1 < writing_until)
        if schedule.due(step + 1):
            schedule.started(step + 1)
            saves += 1
            writing_until = step + 1 + write_steps
    return at_risk, saves, waits


@pytest.mark.parametrize("interval", [1, 5, 50])
@pytest.mark.parametrize("write_steps", [0, 1, 3, 8])
def test_no_moment_has_more_than_the_interval_at_risk(interval: int, write_steps: int) -> None:
    at_risk, saves, _ = simulate(interval, write_steps, 400)
    assert at_risk <= interval
    assert saves >= 400 // interval  # at least as often as before


def test_saves_start_early_by_their_measured_lag_so_the_learner_rarely_waits() -> None:
    at_risk, saves, waits = simulate(50, 3, 1000)
    assert at_risk == 50 and waits <= 3  # the first saves only, until their lag is learnt
    assert saves <= 1000 // 47 + 1  # every 47 steps: the interval less the 3 a write takes
    # The old schedule (every 50 steps, never waiting) had 50 + 3 steps at risk while a save was written.


def test_several_processes_keep_the_fixed_schedule() -> None:
    fixed = CheckpointSchedule(50, adaptive=False)
    assert [s for s in range(1, 201) if fixed.due(s)] == [50, 100, 150, 200]
    assert not fixed.must_wait(10_000)
