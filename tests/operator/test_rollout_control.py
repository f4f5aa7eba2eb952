"""Rollout-tier scaling: saturation, a starved learner waiting on busy servers, idleness."""

from __future__ import annotations

from typing import Any

from stoker.operator.rollout_control import RolloutReading, ServerStats, decide_rollout, rejected_since
from stoker.operator.settings import OperatorSettings

SETTINGS = OperatorSettings()


def server(i: int = 0, **kw: Any) -> ServerStats:
    base: dict[str, Any] = {"address": f"10.0.0.{i}:50053", "max_batch": 32, "batch_occupancy": 0.5, "tokens_per_second": 1000.0}
    return ServerStats(**{**base, **kw})


def decide(reading: RolloutReading, *, target: int = 2, starved: bool | None = False, expected: int | None = None,
           cooled_down: bool = True, lo: int = 1, hi: int = 6) -> Any:
    return decide_rollout(target=target, min_replicas=lo, max_replicas=hi, reading=reading,
                          expected_servers=len(reading.servers) if expected is None else expected,
                          starved=starved, cooled_down=cooled_down, settings=SETTINGS)


def test_a_queue_of_a_quarter_of_the_batch_slots_adds_servers() -> None:
    # 2 servers x 32 slots = 64; 16 waiting is a quarter: saturated.
    queued = RolloutReading((server(0, queue_depth=10), server(1, queue_depth=6)))
    decision = decide(queued, target=2)
    assert decision.target == 3 and decision.actions[0].reason == "ScaledUpRollout"
    assert "generation saturated" in decision.actions[0].message and "queue 16 for 64 batch slots" in decision.actions[0].message
    assert decide(RolloutReading((server(0, queue_depth=10), server(1, queue_depth=5))), target=2).target == 2  # 15 < 16
    # A quarter of the current count, at least one; never above maxReplicas.
    assert decide(RolloutReading(tuple(server(i, queue_depth=32) for i in range(8))), target=8, hi=20).target == 10
    assert decide(queued, target=6, hi=6).target == 6 and decide(queued, target=6, hi=6).actions == ()


def test_refusals_since_the_last_look_are_saturation() -> None:
    assert decide(RolloutReading((server(0),), rejected=3), target=1).target == 2
    previous = {"10.0.0.0:50053": 10, "10.0.0.1:50053": 7}
    # 10 -> 14 is 4 new; a counter that went down (7 -> 2) is a restarted server: 2 new; unseen: 0.
    assert rejected_since(previous, [server(0, rejected_total=14), server(1, rejected_total=2), server(2, rejected_total=9)]) == 6


def test_a_starved_learner_scales_up_only_busy_servers() -> None:
    busy = RolloutReading((server(0, batch_occupancy=0.9), server(1, batch_occupancy=0.8)))
    decision = decide(busy, starved=True)
    assert decision.target == 3 and "learner starved and servers busy" in decision.actions[0].message
    assert decide(busy, starved=False).target == 2  # fed: busy servers are doing their job
    half = RolloutReading((server(0, batch_occupancy=0.5), server(1, batch_occupancy=0.5)))
    assert decide(half, starved=True).target == 2  # the learner waits on something else (actors, sandboxes)


def test_idle_servers_are_given_back_one_at_a_time() -> None:
    idle = RolloutReading((server(0, batch_occupancy=0.1), server(1, batch_occupancy=0.2), server(2, batch_occupancy=0.1)))
    decision = decide(idle, target=3)
    assert decision.target == 2 and decision.actions[0].reason == "ScaledDownRollout"
    assert decide(idle, target=1, lo=1).target == 1  # minReplicas
    assert decide(idle, target=3, starved=True).target == 3  # a starved learner never loses a server
    assert decide(idle, target=3, expected=4).target == 3  # a server did not answer: not known to be idle
    queued = RolloutReading((server(0, batch_occupancy=0.1, queue_depth=1),))
    assert decide(queued, target=2).target == 2


def test_no_decision_without_ready_servers_or_before_the_cooldown() -> None:
    loading = RolloutReading((server(0, ready=False, queue_depth=99, batch_occupancy=0.0),))
    assert decide(loading, target=2).target == 2
    assert decide(RolloutReading(errors=("10.0.0.0:50053: UNAVAILABLE",)), target=2).target == 2
    assert decide(RolloutReading((server(0, queue_depth=99),)), target=2, cooled_down=False).target == 2
    # Not-ready servers' figures stay out of the verdict: the ready one is idle.
    mixed = RolloutReading((server(0, batch_occupancy=0.0), server(1, ready=False, queue_depth=50)))
    assert decide(mixed, target=2, expected=1).target == 1
