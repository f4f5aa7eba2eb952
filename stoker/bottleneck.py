"""What caps a running job's learner duty cycle, in numbers, and the knob that lifts it.

Read from the buffer's Stats (what actors deliver, what the learner takes, fill, drops, the duty
cycle the learner reports) and the spec, so the run report, ``stoker run``'s live progress and the
operator's RLJob status all say the same thing.

When actors are the limit the learner trains a step in ``duty x wall`` of the time it waits for
one, so it would stay busy at ``1 / duty`` times today's delivery: at the same episode latency
that is ``1 / duty`` times as many episodes in flight (Little's law; ``stoker audit`` measures the
latency itself). Admission keeps at most ``(maxStaleness + 1) x batchGroups x groupSize``
episodes outstanding, so beyond that more actors only wait (sizing/audit.py explains the bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from stoker.spec import RLJobSpec

# Below this duty cycle, with the buffer not filling, the learner is waiting for actors.
WAITING_DUTY = 0.8
# The duty a fix aims for: a little short of 1, since supply varies.
TARGET_DUTY = 0.95
# At this fill actors meet backpressure: the learner cannot keep up.
FULL = 0.9
# A share of groups dropped as stale that means data arrives faster than it is trained.
STALE_SHARE = 0.1


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


@dataclass(frozen=True)
class Bottleneck:
    """What limits the loop (``limit``), the numbers that show it, and what to change."""

    limit: Literal["actors", "learner"]
    why: str
    fix: str

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
    factor = TARGET_DUTY / duty
    concurrency = math.ceil(f.concurrency * factor)
    replicas = math.ceil(f.replicas * factor)
    why = (
        f"actors deliver {f.delivered_per_second:.2f} trajectories/s and a step needs {f.trajectories_per_step}, "
        f"so the learner waits {100 * (1 - duty):.0f} % of the time"
    )
    fix = (
        f"raise actors.concurrency from {f.concurrency} to about {concurrency} or actors.replicas from "
        f"{f.replicas} to about {replicas} (stoker audit measures the episode latency behind this figure)"
    )
    in_flight = f.replicas * concurrency
    cap = (f.max_staleness + 1) * f.trajectories_per_step
    if in_flight > cap:
        fix += (
            f"; admission keeps at most (maxStaleness + 1) x {f.trajectories_per_step} = {cap} episodes in flight, "
            f"so raise buffer.maxStaleness (now {f.max_staleness}) or learner.batchGroups as well"
        )
    return Bottleneck("actors", why, fix)


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


def figures_from(stats: Any, spec: RLJobSpec, duty_cycle: float | None) -> LoopFigures:
    """``LoopFigures`` from buffer Stats (the ``stoker.v1.BufferStats`` message, or anything with
    its field names) and the job's spec; ``duty_cycle`` as the learner last reported it."""
    reported = getattr(stats, "max_staleness", None)
    if hasattr(stats, "HasField") and not stats.HasField("max_staleness"):
        reported = None  # a buffer that does not report it runs the spec's
    return LoopFigures(
        duty_cycle=duty_cycle,
        delivered_per_second=float(stats.put_rate),
        sampled_per_second=float(stats.sample_rate),
        fill=float(stats.fill),
        stale_dropped=int(stats.dropped.get("stale", 0)),
        delivered_groups=int(stats.committed_groups_total),
        trajectories_per_step=spec.learner.batch_groups * spec.buffer.group_size,
        replicas=spec.actors.replicas,
        concurrency=spec.actors.concurrency,
        max_staleness=spec.buffer.max_staleness if reported is None else int(reported),
    )
