"""What caps a running job's learner duty cycle, in numbers, and the knob that lifts it.

Read from the buffer's Stats (what actors deliver, what the learner takes, fill, drops, the duty
cycle the learner reports, and each actor's own load, ``actor_loads``) and the spec, so the run
report, ``stoker run``'s live progress and the operator's RLJob status all say the same thing.

When actors are the limit the learner trains a step in ``duty x wall`` of the time it waits for
one, so it would stay busy at ``1 / duty`` times today's delivery. Which knob gets there depends on
what holds the actors back, and their loads say which:

* **CPU-bound**: each actor uses about a core or more. More episodes in flight only queue for that
  core; only more actors, on spare cores, deliver more (about in proportion).
* **admission-bound**: their episode slots are not full, yet they are not busy: they wait for
  admission credit, which ``(maxStaleness + 1) x batchGroups x groupSize`` bounds.
* **latency-bound**: slots full, CPU idle: episodes wait on environments or the sampler's turns.
  More episodes in flight help (Little's law), as far as the actors' CPU, admission and the host's
  spare cores allow; the advice promises the least of those factors.

On one machine (``host``) the spare cores are the ones ``stoker.actor_count`` did not give to the
buffer, the learner or the actors running now; on a cluster each actor brings its own CPU. Advice
that cannot promise a factor (no spare core, admission, no load reported) says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from stoker.actor_count import cluster_actors
from stoker.spec import RLJobSpec

# Below this duty cycle, with the buffer not filling, the learner is waiting for actors.
WAITING_DUTY = 0.8
# The duty a fix aims for: a little short of 1, since supply varies.
TARGET_DUTY = 0.95
# At this fill actors meet backpressure: the learner cannot keep up.
FULL = 0.9
# A share of groups dropped as stale that means data arrives faster than it is trained.
STALE_SHARE = 0.1
# An actor using this many cores is CPU-bound: its Python (episodes, sampling calls) runs under
# one interpreter lock, so about a core is what one actor can use.
CPU_BOUND_CORES = 0.8
# Slots this full mean the actors run all the episodes they may; below it they wait for credit.
SLOTS_FULL = 0.75
# A promised factor below this is no promise worth a change.
MIN_FACTOR = 1.2

Bound = Literal["cpu", "latency", "admission", "unmeasured"]


@dataclass(frozen=True)
class ActorLoad:
    """One actor's own figures (``stoker.v1.ActorLoad``)."""

    cpu_cores: float
    episodes_in_flight: float
    concurrency: int


@dataclass(frozen=True)
class LoadFigures:
    """The reporting actors' loads together."""

    actors: int
    cpu_cores: float  # mean per actor
    episodes_in_flight: float  # summed
    slots: int  # summed concurrency


def combine_loads(loads: Iterable[Any]) -> LoadFigures | None:
    """Actors' loads (anything with ``ActorLoad``'s fields) as one; None when none reported."""
    found = list(loads)
    if not found:
        return None
    return LoadFigures(
        actors=len(found),
        cpu_cores=sum(float(x.cpu_cores) for x in found) / len(found),
        episodes_in_flight=sum(float(x.episodes_in_flight) for x in found),
        slots=sum(int(x.concurrency) for x in found),
    )


@dataclass(frozen=True)
class HostFigures:
    """A local run's machine: its cores and those kept for the buffer and learner."""

    cores: int
    reserved: int


@dataclass(frozen=True)
class LoopFigures:
    """The numbers a diagnosis needs, from the buffer's Stats and the spec."""

    duty_cycle: float | None  # the learner's busy fraction, as it reports it (None: not yet)
    delivered_per_second: float  # trajectories the actors put, per second (Stats.put_rate)
    sampled_per_second: float  # trajectories the learner takes, per second (Stats.sample_rate)
    fill: float  # waiting trajectories / capacity
    stale_dropped: int  # groups dropped as too stale, in all
    delivered_groups: int  # groups handed to the learner, in all
    trajectories_per_step: int  # batchGroups x groupSize
    replicas: int
    concurrency: int  # episodes each actor runs at once
    max_staleness: int
    load: LoadFigures | None = None  # None: no actor reported its load
    host: HostFigures | None = None  # a local run's machine; None on a cluster
    max_replicas: int | None = None  # the autoscaler's ceiling (a cluster's actors.maxReplicas)


@dataclass(frozen=True)
class Bottleneck:
    """What limits the loop (``limit``), the numbers that show it, and what to change: ``knob`` to
    ``value`` for about ``factor`` times today's trajectories/s (None: no factor is promised)."""

    limit: Literal["actors", "learner"]
    why: str
    fix: str
    bound: Bound | None = None  # what holds the actors back, when they are the limit
    knob: str | None = None
    value: int | None = None
    factor: float | None = None

    def __str__(self) -> str:
        return f"{self.why}; {self.fix}"


def diagnose(figures: LoopFigures) -> Bottleneck | None:
    """The loop's bottleneck, or None while it is balanced or there is too little to judge."""
    f = figures
    if f.duty_cycle is None or f.delivered_per_second <= 0:
        return None
    stale_share = f.stale_dropped / max(1, f.stale_dropped + f.delivered_groups)
    if f.duty_cycle < WAITING_DUTY and f.fill < FULL / 2:
        return _actors_limit(f)
    if f.fill >= FULL or stale_share >= STALE_SHARE:
        return _learner_limit(f, stale_share)
    return None


def _actors_limit(f: LoopFigures) -> Bottleneck:
    duty = max(f.duty_cycle or 0.0, 1e-3)
    wanted = TARGET_DUTY / duty
    why = (
        f"actors deliver {f.delivered_per_second:.2f} trajectories/s and a step needs {f.trajectories_per_step}, "
        f"so the learner waits {100 * (1 - duty):.0f} % of the time"
    )
    load = f.load
    if load is None:
        fix = (
            f"raise actors.concurrency (now {f.concurrency}) or actors.replicas (now {f.replicas}) for up to "
            f"{wanted:.1f}x the trajectories/s; the actors report no load, so which of the two helps is not "
            "known and no factor is promised"
        )
        return Bottleneck("actors", why, fix, bound="unmeasured")
    used = f"each actor uses {load.cpu_cores:.2f} cores and runs {load.episodes_in_flight / load.actors:.1f} of " \
           f"its {load.slots / load.actors:.0f} episode slots"
    if load.cpu_cores >= CPU_BOUND_CORES:
        return _cpu_bound(f, why + f"; {used}: CPU-bound", wanted, load)
    if load.episodes_in_flight < SLOTS_FULL * load.slots:
        cap = _admitted_episodes(f)
        fix = (
            f"the actors wait for admission credit: raise buffer.maxStaleness (now {f.max_staleness}, "
            f"(maxStaleness + 1) x {f.trajectories_per_step} = {cap} episodes out at once) or learner.batchGroups; "
            "more actors or concurrency would only wait too. No factor is promised: fresher data is traded for it"
        )
        return Bottleneck("actors", why + f"; {used}", fix, bound="admission", knob="buffer.maxStaleness")
    return _latency_bound(f, why + f"; {used}: latency-bound", wanted, load)


def _admitted_episodes(f: LoopFigures) -> int:
    return (f.max_staleness + 1) * f.trajectories_per_step


def _spare_cores(f: LoopFigures, load: LoadFigures) -> float | None:
    """Cores of a local run's host no part of the run is using; None on a cluster."""
    if f.host is None:
        return None
    return f.host.cores - f.host.reserved - load.cpu_cores * f.replicas


def _cpu_bound(f: LoopFigures, why: str, wanted: float, load: LoadFigures) -> Bottleneck:
    target = math.ceil(f.replicas * wanted)
    room = ""
    fed = math.ceil(_admitted_episodes(f) / f.concurrency)  # more would only wait for credit
    if fed < target:
        target, room = fed, f" (admission keeps {fed} actors of {f.concurrency} episodes busy)"
    spare = _spare_cores(f, load)
    if f.host is not None and spare is not None:
        fits = f.replicas + max(0, math.floor(spare / max(load.cpu_cores, 1e-3)))
        if fits < target:
            target, room = fits, f" (the host's {f.host.cores} cores have room for {fits - f.replicas} more)"
    if target <= f.replicas:
        where = (f"this host has no spare core for another actor ({f.host.cores} cores: {f.host.reserved} for the buffer "
                 "and learner, the rest busy with actors): only more cores help (a larger host, or the cluster)"
                 if f.host is not None and room.startswith(" (the host") else
                 f"admission lets no more actors work{room}: raise buffer.maxStaleness or learner.batchGroups")
        fix = f"more episodes in flight (actors.concurrency) would not help, and {where}; no factor can be promised"
        return Bottleneck("actors", why, fix, bound="cpu", knob="actors.replicas")
    factor = target / max(f.replicas, 1)
    fix = (
        f"raise actors.replicas from {f.replicas} to {target}{room}: about {factor:.1f}x the trajectories/s; "
        "more episodes in flight (actors.concurrency) would not help"
    )
    if f.max_replicas is not None and target > f.max_replicas:
        fix += f" (and actors.maxReplicas, now {f.max_replicas}, to at least {target})"
    return Bottleneck("actors", why, fix, bound="cpu", knob="actors.replicas", value=target, factor=factor)


def _latency_bound(f: LoopFigures, why: str, wanted: float, load: LoadFigures) -> Bottleneck:
    # Each actor's throughput grows with its episodes in flight until its CPU saturates ...
    factors = {"the learner's waiting": wanted, "the actors' CPU": CPU_BOUND_CORES / max(load.cpu_cores, 1e-3)}
    # ... admission lets only so many episodes out ...
    factors["admission"] = _admitted_episodes(f) / max(load.episodes_in_flight, 1e-3)
    # ... and on one machine the actors' extra CPU must fit in the spare cores.
    spare = _spare_cores(f, load)
    if spare is not None:
        factors["the host's spare cores"] = 1 + max(spare, 0.0) / max(load.cpu_cores * f.replicas, 1e-3)
    limit, factor = min(factors.items(), key=lambda item: item[1])
    if factor < MIN_FACTOR:
        fix = (
            f"more episodes in flight would help, but {limit} leaves no room for them: "
            + ("raise buffer.maxStaleness or learner.batchGroups" if limit == "admission" else "only more cores help")
            + "; no factor can be promised"
        )
        return Bottleneck("actors", why, fix, bound="latency")
    target = math.ceil(f.concurrency * factor)
    fix = f"raise actors.concurrency from {f.concurrency} to {target}: about {factor:.1f}x the trajectories/s"
    if limit != "the learner's waiting":
        fix += f" (as far as {limit} allows; the learner would take {wanted:.1f}x)"
    return Bottleneck("actors", why, fix, bound="latency", knob="actors.concurrency", value=target, factor=factor)


def _learner_limit(f: LoopFigures, stale_share: float) -> Bottleneck:
    parts = []
    if f.fill >= FULL:
        parts.append(f"the buffer is {100 * f.fill:.0f} % full, so actors wait on backpressure")
    if stale_share >= STALE_SHARE:
        parts.append(f"{100 * stale_share:.0f} % of groups were dropped as too stale")
    why = (
        f"the learner takes {f.sampled_per_second:.2f} trajectories/s while actors deliver "
        f"{f.delivered_per_second:.2f}: " + " and ".join(parts)
    )
    surplus = f.delivered_per_second / f.sampled_per_second if f.sampled_per_second > 0 else math.inf
    fewer = max(1, math.ceil(f.replicas / surplus)) if math.isfinite(surplus) else 1
    fix = (
        f"the learner is the bottleneck: a larger learner slice or smaller steps (learner.batchGroups) keep up, "
        f"or actors.replicas from {f.replicas} to about {fewer} stops overproducing"
    )
    return Bottleneck("learner", why, fix)


def figures_from(
    stats: Any, spec: RLJobSpec, duty_cycle: float | None, *, replicas: int | None = None,
    host: HostFigures | None = None,
) -> LoopFigures:
    """``LoopFigures`` from buffer Stats (the ``stoker.v1.BufferStats`` message, or anything with
    its field names) and the job's spec; ``duty_cycle`` as the learner last reported it;
    ``replicas`` the actors running (the spec's, or what an unset one came to, when not given);
    ``host`` for a local run."""
    reported = getattr(stats, "max_staleness", None)
    if hasattr(stats, "HasField") and not stats.HasField("max_staleness"):
        reported = None  # a buffer that does not report it runs the spec's
    loads = getattr(stats, "actor_loads", None) or {}
    return LoopFigures(
        duty_cycle=duty_cycle,
        delivered_per_second=float(stats.put_rate),
        sampled_per_second=float(stats.sample_rate),
        fill=float(stats.fill),
        stale_dropped=int(stats.dropped.get("stale", 0)),
        delivered_groups=int(stats.committed_groups_total),
        trajectories_per_step=spec.learner.batch_groups * spec.buffer.group_size,
        replicas=replicas if replicas is not None else cluster_actors(spec),
        concurrency=spec.actors.concurrency,
        max_staleness=spec.buffer.max_staleness if reported is None else int(reported),
        load=combine_loads(loads.values()),
        host=host,
        max_replicas=spec.actors.max_replicas if host is None else None,
    )
