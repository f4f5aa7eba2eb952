"""The loop's bottleneck, named with its numbers and the knob that lifts it."""

from __future__ import annotations

from dataclasses import replace

from stoker.bottleneck import LoopFigures, diagnose

# The FrozenLake example with 0.5 s environment steps, as measured (2 actors x 8 episodes).
STARVED = LoopFigures(
    duty_cycle=0.049, delivered_per_second=4.75, sampled_per_second=4.75, fill=0.02, stale_dropped=0,
    delivered_groups=120, trajectories_per_step=32, replicas=2, concurrency=8, max_staleness=4,
)


def test_starved_learner_names_the_actors_with_the_rates_and_the_knob() -> None:
    found = diagnose(STARVED)
    assert found is not None and found.limit == "actors"
    assert "actors deliver 4.75 trajectories/s and a step needs 32" in found.why
    assert "learner waits 95 % of the time" in found.why
    # 0.95 / 0.049 = 19.4x as many episodes in flight.
    assert "actors.concurrency from 8 to about 156" in found.fix
    assert "actors.replicas from 2 to about 39" in found.fix
    # 2 x 156 episodes in flight exceed what admission lets out at maxStaleness 4: (4 + 1) x 32.
    assert "(maxStaleness + 1) x 32 = 160" in found.fix


def test_no_staleness_note_when_admission_allows_the_needed_episodes() -> None:
    found = diagnose(replace(STARVED, duty_cycle=0.5, max_staleness=8))
    assert found is not None and found.limit == "actors"
    assert "to about 16 " in found.fix and "maxStaleness" not in found.fix


def test_a_full_buffer_or_stale_drops_name_the_learner() -> None:
    full = diagnose(replace(STARVED, duty_cycle=0.99, fill=0.97, delivered_per_second=12.0, sampled_per_second=4.0))
    assert full is not None and full.limit == "learner"
    assert "the buffer is 97 % full" in full.why and "learner takes 4.00 trajectories/s" in full.why
    assert "actors.replicas from 2 to about 1" in full.fix
    stale = diagnose(replace(STARVED, duty_cycle=0.97, fill=0.3, stale_dropped=30, delivered_groups=70))
    assert stale is not None and stale.limit == "learner" and "30 % of groups were dropped as too stale" in stale.why


def test_a_balanced_or_unmeasured_loop_names_nothing() -> None:
    assert diagnose(replace(STARVED, duty_cycle=0.97, fill=0.4)) is None
    assert diagnose(replace(STARVED, duty_cycle=None)) is None
    assert diagnose(replace(STARVED, delivered_per_second=0.0)) is None
