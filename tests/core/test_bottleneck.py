"""The loop's bottleneck, named with its numbers and the knob that lifts it: CPU-bound actors get
replicas (where there are cores), latency-bound ones concurrency, admission-bound ones staleness."""

from __future__ import annotations

from dataclasses import replace

from stoker.bottleneck import HostFigures, LoadFigures, LoopFigures, diagnose, figures_from
from stoker.spec import RLJobSpec
from stoker.v1 import buffer_pb2

# The FrozenLake example with 0.5 s environment steps, as measured (2 actors x 8 episodes).
STARVED = LoopFigures(
    duty_cycle=0.049, delivered_per_second=4.75, sampled_per_second=4.75, fill=0.02, stale_dropped=0,
    delivered_groups=120, trajectories_per_step=32, replicas=2, concurrency=8, max_staleness=4,
)
# Its actors waiting on the environment: every slot full, little CPU.
WAITING = LoadFigures(actors=2, cpu_cores=0.05, episodes_in_flight=16.0, slots=16)
# Issue 50 on the v5e host: 2 actors x 8 on 13 cores, each busy sampling (about a core each),
# the learner busy 41 % of the time.
ON_THE_TPU_HOST = LoopFigures(
    duty_cycle=0.41, delivered_per_second=47.0, sampled_per_second=47.0, fill=0.05, stale_dropped=0,
    delivered_groups=400, trajectories_per_step=32, replicas=2, concurrency=8, max_staleness=2,
    load=LoadFigures(actors=2, cpu_cores=0.97, episodes_in_flight=15.6, slots=16),
    host=HostFigures(cores=13, reserved=2),
)


def test_cpu_bound_actors_get_replicas_not_concurrency() -> None:
    found = diagnose(ON_THE_TPU_HOST)
    assert found is not None and found.limit == "actors" and found.bound == "cpu"
    assert "each actor uses 0.97 cores and runs 7.8 of its 8 episode slots: CPU-bound" in found.why
    # 0.95 / 0.41 = 2.3x the actors: 5, on cores the host has spare (13 - 2 - 1.94).
    assert found.knob == "actors.replicas" and found.value == 5 and found.factor == 2.5
    assert "raise actors.replicas from 2 to 5: about 2.5x the trajectories/s" in found.fix
    assert "actors.concurrency) would not help" in found.fix
    # Four times the concurrency changed nothing there: the advice stays replicas (not concurrency 235).
    at_32 = diagnose(replace(ON_THE_TPU_HOST, concurrency=32, load=replace(ON_THE_TPU_HOST.load, slots=64)))
    assert at_32 is not None and at_32.knob == "actors.replicas" and "concurrency from" not in at_32.fix


def test_cpu_bound_actors_on_a_full_host_get_no_promise() -> None:
    two_cores = replace(ON_THE_TPU_HOST, replicas=1, host=HostFigures(cores=2, reserved=2),
                        load=LoadFigures(actors=1, cpu_cores=0.95, episodes_in_flight=8.0, slots=8))
    found = diagnose(two_cores)
    assert found is not None and found.bound == "cpu" and found.factor is None and found.value is None
    assert "no spare core for another actor (2 cores" in found.fix and "no factor can be promised" in found.fix
    # Spare cores bound the count: 6 cores hold 2 more actors of 0.97 cores, not the 3 the learner wants.
    six = diagnose(replace(ON_THE_TPU_HOST, host=HostFigures(cores=6, reserved=2)))
    assert six is not None and six.value == 4 and "have room for 2 more" in six.fix
    # On a cluster no host bounds them, but the autoscaler's ceiling is named.
    cluster = diagnose(replace(ON_THE_TPU_HOST, host=None, max_replicas=4))
    assert cluster is not None and cluster.value == 5 and "actors.maxReplicas, now 4, to at least 5" in cluster.fix


def test_latency_bound_actors_get_concurrency_as_far_as_admission_allows() -> None:
    found = diagnose(replace(STARVED, load=WAITING))
    assert found is not None and found.bound == "latency" and found.knob == "actors.concurrency"
    assert "actors deliver 4.75 trajectories/s and a step needs 32" in found.why
    assert "learner waits 95 % of the time" in found.why and "latency-bound" in found.why
    # The learner would take 19.4x, the actors' CPU 16x, admission (4 + 1) x 32 = 160 episodes: 10x.
    assert found.factor == 10.0 and found.value == 80
    assert "raise actors.concurrency from 8 to 80: about 10.0x" in found.fix and "as far as admission allows" in found.fix
    # With room in admission and CPU, the learner's waiting is the promise.
    roomy = diagnose(replace(STARVED, duty_cycle=0.5, max_staleness=8, load=WAITING))
    assert roomy is not None and roomy.factor == 1.9 and roomy.value == 16 and "as far as" not in roomy.fix


def test_latency_bound_actors_on_a_busy_host_are_held_to_its_spare_cores() -> None:
    busier = LoadFigures(actors=2, cpu_cores=0.1, episodes_in_flight=16.0, slots=16)
    found = diagnose(replace(STARVED, load=busier, host=HostFigures(cores=3, reserved=2)))
    # 3 - 2 - 0.2 = 0.8 spare cores over the actors' 0.2: 5x at most (their CPU alone would allow 8x).
    assert found is not None and found.factor == 5.0 and found.value == 40
    assert "as far as the host's spare cores allows" in found.fix
    full = diagnose(replace(STARVED, load=busier, host=HostFigures(cores=2, reserved=2)))
    assert full is not None and full.factor is None and "no factor can be promised" in full.fix


def test_actors_with_idle_slots_wait_for_admission() -> None:
    idle = LoadFigures(actors=2, cpu_cores=0.1, episodes_in_flight=6.0, slots=16)
    found = diagnose(replace(STARVED, load=idle))
    assert found is not None and found.bound == "admission" and found.factor is None
    assert "runs 3.0 of its 8 episode slots" in found.why
    assert "wait for admission credit: raise buffer.maxStaleness (now 4" in found.fix


def test_unmeasured_actors_get_both_knobs_and_no_promise() -> None:
    found = diagnose(STARVED)
    assert found is not None and found.bound == "unmeasured" and found.factor is None
    assert "actors.concurrency (now 8) or actors.replicas (now 2) for up to 19.4x" in found.fix


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


def test_figures_read_the_actors_loads_from_stats() -> None:
    stats = buffer_pb2.BufferStats(put_rate=4.0, sample_rate=4.0, fill=0.01, committed_groups_total=3)
    stats.actor_loads["actor-0"].CopyFrom(buffer_pb2.ActorLoad(cpu_cores=0.9, episodes_in_flight=7.0, concurrency=8))
    stats.actor_loads["actor-1"].CopyFrom(buffer_pb2.ActorLoad(cpu_cores=0.7, episodes_in_flight=5.0, concurrency=8))
    spec = RLJobSpec.model_validate({"actors": {"concurrency": 8}, "buffer": {"maxStaleness": 2, "groupSize": 8},
                                     "learner": {"batchGroups": 4}})
    figures = figures_from(stats, spec, 0.3, replicas=2)
    assert figures.load == LoadFigures(actors=2, cpu_cores=0.8, episodes_in_flight=12.0, slots=16)
    assert figures.replicas == 2 and figures.max_replicas == 8 and figures.host is None
    # Unset replicas on a cluster: as many as admission keeps busy, (2 + 1) x 32 / 8 = 12, within maxReplicas 8.
    assert figures_from(stats, spec, 0.3).replicas == 8
    assert figures_from(buffer_pb2.BufferStats(put_rate=1.0), spec, 0.3).load is None
