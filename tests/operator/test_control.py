"""Enforcement decisions: staleness windows, quantiles, and bounded scaling."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.bottleneck import ActorLoad
from stoker.operator.control import (
    actors_diagnosis,
    decide,
    histogram_quantile,
    StalenessWindow,
    learner_starved,
    overproducing,
    staleness_exceeded,
    staleness_window,
)
from stoker.operator.observe import StatsSnapshot, snapshot_from_proto
from stoker.operator.settings import OperatorSettings
from stoker.spec import RLJobSpec
from stoker.v1 import buffer_pb2

SETTINGS = OperatorSettings(scale_step_fraction=0.25, min_admission_scale=0.125)


def snap(hist: dict[int, int], stale: int = 0, **kw: object) -> StatsSnapshot:
    return StatsSnapshot(staleness_histogram=hist, dropped={"stale": stale}, **kw)  # type: ignore[arg-type]


def test_window_is_the_difference_of_cumulative_histograms() -> None:
    first = staleness_window(None, snap({0: 10, 3: 2}))
    assert (first.p50, first.max, first.groups) == (0, 3, 12)
    later = staleness_window(snap({0: 10, 3: 2}, stale=1), snap({0: 10, 3: 2, 6: 4}, stale=3))
    assert (later.p50, later.max, later.dropped, later.groups) == (6, 6, 2, 4)
    quiet = staleness_window(snap({0: 10}), snap({0: 10}))
    assert (quiet.max, quiet.groups) == (0, 0) and not staleness_exceeded(quiet, 0)


def test_buffer_restart_resets_the_window() -> None:
    window = staleness_window(snap({0: 100, 5: 100}, stale=50), snap({1: 3}, stale=0))
    assert (window.max, window.groups, window.dropped) == (1, 3, 0)


def test_exceeded_by_lag_or_by_stale_drops() -> None:
    assert staleness_exceeded(staleness_window(None, snap({5: 1})), 4)
    assert not staleness_exceeded(staleness_window(None, snap({4: 1})), 4)
    assert staleness_exceeded(staleness_window(None, snap({0: 1}, stale=1)), 4)


def test_starvation_needs_a_reported_duty_cycle() -> None:
    assert learner_starved(StatsSnapshot(complete_groups=0, learner_duty_cycle=0.2), 0.5) is True
    assert learner_starved(StatsSnapshot(complete_groups=3, learner_duty_cycle=0.2), 0.5) is False
    assert learner_starved(StatsSnapshot(complete_groups=0, learner_duty_cycle=0.9), 0.5) is False
    assert learner_starved(StatsSnapshot(complete_groups=0), 0.5) is None


@given(st.dictionaries(st.integers(0, 20), st.integers(0, 50), max_size=8), st.floats(0.01, 1.0))
def test_quantile_matches_the_expanded_sample(hist: dict[int, int], q: float) -> None:
    sample = sorted(v for v, c in hist.items() for _ in range(c))
    got = histogram_quantile(hist, q)
    if not sample:
        assert got == 0
        return
    # the smallest value whose cumulative share reaches q
    expected = next(v for i, v in enumerate(sample) if (i + 1) >= q * len(sample))
    assert got == expected


def test_decisions() -> None:
    down = decide(actor_target=8, admission_scale=1.0, min_replicas=2, max_replicas=10, exceeded=True,
                  starved=False, cooled_down=True, settings=SETTINGS)
    assert (down.actor_target, down.admission_scale) == (6, 0.5)
    assert [a.reason for a in down.actions] == ["TightenedAdmission", "ScaledDownActors"]
    waiting = decide(actor_target=8, admission_scale=1.0, min_replicas=2, max_replicas=10, exceeded=True,
                     starved=False, cooled_down=False, settings=SETTINGS)
    assert waiting.actor_target == 8 and waiting.admission_scale == 0.5  # admission acts at once
    up = decide(actor_target=3, admission_scale=0.25, min_replicas=2, max_replicas=10, exceeded=False,
                starved=True, cooled_down=True, settings=SETTINGS)
    assert (up.actor_target, up.admission_scale) == (4, 1.0)
    calm = decide(actor_target=3, admission_scale=0.25, min_replicas=2, max_replicas=10, exceeded=False,
                  starved=None, cooled_down=True, settings=SETTINGS)
    assert (calm.actor_target, calm.admission_scale) == (3, 0.5)
    idle = decide(actor_target=3, admission_scale=1.0, min_replicas=2, max_replicas=10, exceeded=False,
                  starved=False, cooled_down=True, settings=SETTINGS)
    assert idle.actions == ()


@settings(max_examples=300)
@given(
    bounds=st.tuples(st.integers(0, 20), st.integers(1, 40)).filter(lambda b: b[0] <= b[1]),
    target=st.integers(0, 40),
    scale=st.sampled_from([0.125, 0.25, 0.5, 1.0]),
    exceeded=st.booleans(),
    starved=st.none() | st.booleans(),
    cooled=st.booleans(),
    overproduced=st.booleans(),
)
def test_decisions_stay_within_bounds(bounds: tuple[int, int], target: int, scale: float, exceeded: bool,
                                      starved: bool | None, cooled: bool, overproduced: bool) -> None:
    low, high = bounds
    target = max(low, min(high, target))
    d = decide(actor_target=target, admission_scale=scale, min_replicas=low, max_replicas=high, exceeded=exceeded,
               starved=starved, cooled_down=cooled, settings=SETTINGS, overproduced=overproduced)
    assert low <= d.actor_target <= high
    assert SETTINGS.min_admission_scale <= d.admission_scale <= 1.0
    if exceeded or overproduced:
        assert d.actor_target <= target and d.admission_scale <= scale
    if not cooled:
        assert d.actor_target == target
    assert len(d.actions) == (d.actor_target != target) + (d.admission_scale != scale)


def test_newest_first_drops_are_overproduction_not_staleness() -> None:
    """Under newest-first the backlog ages out by design: drops alone do not mean the learner
    trains on stale data, so they get the gentler overproduction response."""
    drops_only = StalenessWindow(p50=1, max=2, dropped=5, groups=10)
    sampled_stale = StalenessWindow(p50=1, max=6, dropped=5, groups=10)
    assert staleness_exceeded(drops_only, 4, "oldest-first")
    assert not staleness_exceeded(drops_only, 4, "newest-first") and overproducing(drops_only, 4, "newest-first")
    assert staleness_exceeded(sampled_stale, 4, "newest-first") and not overproducing(sampled_stale, 4, "newest-first")
    assert not overproducing(drops_only, 4, "oldest-first")
    gentle = decide(actor_target=8, admission_scale=1.0, min_replicas=2, max_replicas=10, exceeded=False,
                    starved=False, cooled_down=True, settings=SETTINGS, overproduced=True)
    harsh = decide(actor_target=8, admission_scale=1.0, min_replicas=2, max_replicas=10, exceeded=True,
                   starved=False, cooled_down=True, settings=SETTINGS)
    assert (gentle.actor_target, gentle.admission_scale) == (7, 0.75)
    assert gentle.actor_target > harsh.actor_target and gentle.admission_scale > harsh.admission_scale
    assert all("overproduction" in a.message for a in gentle.actions)


# Issue 50's actors as the operator sees them: 2 x 8 episodes, each using about a core, the
# learner busy 41 % of the time with a group still buffered (so not "starved").
SPEC = RLJobSpec.model_validate({"actors": {"replicas": 2, "concurrency": 8, "maxReplicas": 10},
                                 "buffer": {"groupSize": 8, "maxStaleness": 2}, "learner": {"batchGroups": 4}})


def _stats(cpu: float, in_flight: float, duty: float = 0.41) -> StatsSnapshot:
    loads = {f"actor-{i}": ActorLoad(cpu, in_flight, 8) for i in range(2)}
    return StatsSnapshot(complete_groups=1, learner_duty_cycle=duty, put_rate=47.0, sample_rate=47.0, fill=0.05,
                         committed_groups_total=400, actor_loads=loads)


def test_cpu_bound_actors_get_replicas_even_before_the_buffer_empties() -> None:
    cpu_bound = actors_diagnosis(_stats(0.97, 7.8), SPEC, 2)
    assert cpu_bound is not None and cpu_bound.bound == "cpu" and cpu_bound.value == 5
    up = decide(actor_target=2, admission_scale=1.0, min_replicas=1, max_replicas=10, exceeded=False,
                starved=False, cooled_down=True, settings=SETTINGS, actors=cpu_bound)
    assert up.actor_target == 3 and "actors CPU-bound" in up.actions[0].message
    # Never past what the diagnosis asks for.
    near = decide(actor_target=4, admission_scale=1.0, min_replicas=1, max_replicas=10, exceeded=False,
                  starved=True, cooled_down=True, settings=SETTINGS, actors=actors_diagnosis(_stats(0.97, 7.8), SPEC, 4))
    assert near.actor_target == 5


def test_actors_waiting_for_admission_get_no_replicas_and_latency_bound_ones_a_note() -> None:
    waiting = actors_diagnosis(_stats(0.1, 3.0), SPEC, 2)
    assert waiting is not None and waiting.bound == "admission"
    held = decide(actor_target=2, admission_scale=1.0, min_replicas=1, max_replicas=10, exceeded=False,
                  starved=True, cooled_down=True, settings=SETTINGS, actors=waiting)
    assert held.actor_target == 2 and held.actions == ()
    latency = actors_diagnosis(_stats(0.1, 7.9), SPEC, 2)
    assert latency is not None and latency.bound == "latency"
    up = decide(actor_target=2, admission_scale=1.0, min_replicas=1, max_replicas=10, exceeded=False,
                starved=True, cooled_down=True, settings=SETTINGS, actors=latency)
    assert up.actor_target == 3 and f"actors.concurrency {latency.value} would do it with fewer pods" in up.actions[0].message
    # Not starved and not CPU-bound: nothing moves.
    calm = decide(actor_target=2, admission_scale=1.0, min_replicas=1, max_replicas=10, exceeded=False,
                  starved=False, cooled_down=True, settings=SETTINGS, actors=latency)
    assert calm.actor_target == 2


def test_the_actors_loads_reach_the_operator_from_stats() -> None:
    stats = buffer_pb2.BufferStats(put_rate=47.0)
    stats.actor_loads["actor-0"].CopyFrom(buffer_pb2.ActorLoad(cpu_cores=0.97, episodes_in_flight=7.8, concurrency=8))
    assert snapshot_from_proto(stats).actor_loads == {"actor-0": ActorLoad(0.97, 7.8, 8)}
