"""Enforcement: staleness and starvation -> actor replicas and the buffer's admission scale.

Scaling up reads the actors' diagnosis (``stoker.bottleneck``, as the status shows it): CPU-bound
actors get more replicas, even while the buffer still holds a group; admission-bound ones get
none, since new actors would only wait for credit too; latency-bound ones get more as well (the
operator's knob), with a note that ``actors.concurrency`` would do it with fewer pods.

Pure functions over successive buffer snapshots; the timer applies the decision and posts one
Event per action.

Staleness is read from the buffer's histogram of "versions behind at sample time", which counts
since the buffer started. The operator looks at the *window* between two observations,

.. math::  h_w(v) = h_t(v) - h_{t-1}(v),

so an old burst of stale data does not keep the condition raised forever.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from stoker.bottleneck import Bottleneck, diagnose, figures_from
from stoker.operator.observe import StatsSnapshot
from stoker.operator.settings import OperatorSettings
from stoker.spec import RLJobSpec

STALE_DROP_REASON = "stale"
OVERPRODUCTION_ADMISSION_FACTOR = 0.75


@dataclass(frozen=True)
class StalenessWindow:
    p50: int
    max: int
    dropped: int
    """Groups dropped as too stale in the window."""
    groups: int
    """Groups sampled in the window."""


def histogram_quantile(histogram: Mapping[int, int], q: float) -> int:
    """Smallest staleness ``v`` with at least a fraction ``q`` of the mass at or below it (0 if empty)."""
    total = sum(count for count in histogram.values() if count > 0)
    if total == 0:
        return 0
    running = 0
    for value in sorted(histogram):
        running += max(histogram[value], 0)
        if running >= q * total:
            return value
    return max(histogram)


def staleness_window(previous: StatsSnapshot | None, current: StatsSnapshot) -> StalenessWindow:
    """Staleness over the groups sampled since ``previous`` (all of them when there is none).

    A counter that went down means the buffer restarted: the window is then the current counts.
    """
    cur_hist = dict(current.staleness_histogram)
    cur_dropped = current.dropped.get(STALE_DROP_REASON, 0)
    if previous is not None:
        prev_hist = previous.staleness_histogram
        if all(cur_hist.get(v, 0) >= c for v, c in prev_hist.items()):
            cur_hist = {v: c - prev_hist.get(v, 0) for v, c in cur_hist.items()}
        prev_dropped = previous.dropped.get(STALE_DROP_REASON, 0)
        if cur_dropped >= prev_dropped:
            cur_dropped -= prev_dropped
    window = {v: c for v, c in cur_hist.items() if c > 0}
    return StalenessWindow(
        p50=histogram_quantile(window, 0.5),
        max=max(window, default=0),
        dropped=cur_dropped,
        groups=sum(window.values()),
    )


def staleness_exceeded(window: StalenessWindow, max_staleness: int, sample_order: str = "oldest-first") -> bool:
    """Groups sampled above the limit, or (oldest-first) dropped as stale.

    Under ``newest-first`` the learner takes the latest groups and the backlog ages out by
    design, so drops there are overproduction (``overproducing``), not staleness reaching the
    learner.
    """
    if sample_order == "newest-first":
        return window.max > max_staleness
    return window.max > max_staleness or window.dropped > 0


def overproducing(window: StalenessWindow, max_staleness: int, sample_order: str) -> bool:
    """Newest-first groups aging out unsampled: actors make more than the learner takes."""
    return sample_order == "newest-first" and window.dropped > 0 and not window.max > max_staleness


def learner_starved(stats: StatsSnapshot, threshold: float) -> bool | None:
    """Buffer empty and learner mostly idle; ``None`` when the learner reports no duty cycle."""
    if stats.learner_duty_cycle is None:
        return None
    return stats.complete_groups == 0 and stats.learner_duty_cycle < threshold


def actors_diagnosis(stats: StatsSnapshot | None, spec: RLJobSpec, actor_target: int) -> Bottleneck | None:
    """What caps the learner now (``stoker.bottleneck``) with ``actor_target`` actors running;
    None without Stats or while balanced."""
    if stats is None:
        return None
    return diagnose(figures_from(stats, spec, stats.learner_duty_cycle, replicas=actor_target))


def _scale_up_note(actors: Bottleneck | None) -> str:
    if actors is None or actors.limit != "actors":
        return ""
    if actors.bound == "cpu":
        return "; actors CPU-bound"
    if actors.bound == "latency" and actors.knob == "actors.concurrency":
        return f"; actors latency-bound: actors.concurrency {actors.value} would do it with fewer pods"
    return ""


@dataclass(frozen=True)
class Action:
    """One enforcement step, reported as an Event on the RLJob."""

    reason: str
    message: str
    type: str = "Normal"


@dataclass(frozen=True)
class Decision:
    actor_target: int
    admission_scale: float
    actions: tuple[Action, ...] = field(default_factory=tuple)


def scale_step(current: int, fraction: float) -> int:
    """One scaling action's size: ``fraction`` of the current count, at least one replica."""
    return max(1, math.ceil(current * fraction))


def decide(
    *,
    actor_target: int,
    admission_scale: float,
    min_replicas: int,
    max_replicas: int,
    exceeded: bool,
    starved: bool | None,
    cooled_down: bool,
    settings: OperatorSettings,
    detail: str = "",
    overproduced: bool = False,
    actors: Bottleneck | None = None,
) -> Decision:
    """Next actor target and admission scale.

    * staleness exceeded: fewer actors (not below ``min_replicas``) and admission halved (not
      below ``settings.min_admission_scale``);
    * overproduction (newest-first groups dropped unsampled): the gentler version, one actor
      fewer and admission cut by a quarter, since the learner itself still gets fresh data;
    * learner starved, or ``actors`` diagnosed CPU-bound: admission restored to 1 and more actors
      (not above ``max_replicas``, nor the diagnosis' count); none while the diagnosis says the
      actors wait for admission credit (more of them would wait too);
    * otherwise admission relaxes back towards 1 (doubling) while nothing is exceeded.

    Replica changes wait for ``cooled_down`` so one burst does not empty or flood the pool.
    """
    target, scale = actor_target, admission_scale
    actions: list[Action] = []
    suffix = f" ({detail})" if detail else ""
    if exceeded:
        new_scale = max(settings.min_admission_scale, scale / 2)
        if new_scale < scale:
            actions.append(
                Action("TightenedAdmission", f"buffer admission scale {scale:g} -> {new_scale:g}{suffix}", "Warning")
            )
            scale = new_scale
        if cooled_down and target > min_replicas:
            new_target = max(min_replicas, target - scale_step(target, settings.scale_step_fraction))
            actions.append(Action("ScaledDownActors", f"actors {target} -> {new_target}: staleness above limit{suffix}", "Warning"))
            target = new_target
    elif overproduced:
        new_scale = max(settings.min_admission_scale, scale * OVERPRODUCTION_ADMISSION_FACTOR)
        if new_scale < scale:
            actions.append(Action("TightenedAdmission", f"buffer admission scale {scale:g} -> {new_scale:g}: "
                                  f"stale groups dropped unsampled (overproduction){suffix}"))
            scale = new_scale
        if cooled_down and target > min_replicas:
            actions.append(Action("ScaledDownActors", f"actors {target} -> {target - 1}: "
                                  f"stale groups dropped unsampled (overproduction){suffix}"))
            target -= 1
    elif starved or (actors is not None and actors.bound == "cpu" and actors.value is not None):
        if scale < 1.0:
            actions.append(Action("RelaxedAdmission", f"buffer admission scale {scale:g} -> 1: learner starved{suffix}"))
            scale = 1.0
        admission_bound = actors is not None and actors.bound == "admission"
        ceiling = max_replicas
        if actors is not None and actors.knob == "actors.replicas" and actors.value is not None:
            ceiling = min(max_replicas, actors.value)  # what the diagnosis asks for, no more
        if cooled_down and target < ceiling and not admission_bound:
            new_target = min(ceiling, target + scale_step(target, settings.scale_step_fraction))
            actions.append(Action("ScaledUpActors", f"actors {target} -> {new_target}: learner starved"
                                  f"{_scale_up_note(actors)}{suffix}"))
            target = new_target
    elif scale < 1.0:
        new_scale = min(1.0, scale * 2)
        actions.append(Action("RelaxedAdmission", f"buffer admission scale {scale:g} -> {new_scale:g}: staleness back within limit"))
        scale = new_scale
    return Decision(actor_target=target, admission_scale=scale, actions=tuple(actions))


def clamp_replicas(replicas: int, min_replicas: int, max_replicas: int) -> int:
    return max(min_replicas, min(max_replicas, replicas))
