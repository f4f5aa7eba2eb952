"""Restarts per component and the RLJob's ``Degraded`` and ``Recovering`` conditions.

Pure: the pod index's records and the learner's JobSet restarts in, conditions out. ``Recovering``
is True while a component that died is coming back (a restarted container starting, a JobSet
restarting its slices, a Deployment replacing a pod); ``Degraded`` while a component is down once
the job has run, or one that died cannot come back by itself (a crash loop, an image it cannot
pull, a learner out of restarts). Both messages name the component, how often it restarted and why
it last stopped, e.g. "buffer pod restarted 2 times, last: OOMKilled".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stoker.operator.conditions import Cond
from stoker.operator.naming import ROLE_ACTOR, ROLE_BUFFER, ROLE_LEARNER, ROLE_ROLLOUT
from stoker.operator.zombies import PodRecord

LEARNER, BUFFER, ACTORS, ROLLOUT = "learner", "buffer", "actors", "rollout"
COMPONENT_OF_ROLE = {ROLE_LEARNER: LEARNER, ROLE_BUFFER: BUFFER, ROLE_ACTOR: ACTORS, ROLE_ROLLOUT: ROLLOUT}
_PODS = {LEARNER: "learner pods", BUFFER: "buffer pod", ACTORS: "actor pods", ROLLOUT: "rollout server pods"}


@dataclass(frozen=True)
class Restarts:
    """One component's restarts as its live pods and workload show them."""

    pods: int = 0
    """Container restarts summed over the component's pods; with ``restart_ledger``, also those of
    its pods that are gone, and one per pod replaced."""
    workload: int = 0
    """Whole-group restarts by the learner's JobSet (``status.restarts``): a lost pod or slice."""
    last_reason: str = ""
    waiting: str = ""
    """A back-off reason one of its pods is stuck in now (``podhealth.BACK_OFF_REASONS``)."""

    @property
    def total(self) -> int:
        return self.pods + self.workload


def component_restarts(pods: Iterable[PodRecord], learner_workload_restarts: int = 0) -> dict[str, Restarts]:
    """Per component, from one job's pod records (sandbox pods are nobody's component)."""
    grouped: dict[str, list[PodRecord]] = {}
    for pod in pods:
        if pod.role in COMPONENT_OF_ROLE:
            grouped.setdefault(COMPONENT_OF_ROLE[pod.role], []).append(pod)
    out: dict[str, Restarts] = {}
    for component in (LEARNER, BUFFER, ACTORS, ROLLOUT):
        members = [p.health for p in grouped.get(component, [])]
        stopped = [(h.last_finished, h.last_reason) for h in members if h.last_reason]
        out[component] = Restarts(
            pods=sum(h.restarts for h in members),
            workload=learner_workload_restarts if component == LEARNER else 0,
            last_reason=max(stopped)[1] if stopped else "",
            waiting=next((h.waiting for h in members if h.waiting), ""),
        )
    return out


@dataclass(frozen=True)
class Part:
    """A component of this job as the status sees it."""

    name: str
    down: bool
    """Its readiness condition is False (for a reason other than suspend or completion)."""
    restarts: Restarts = Restarts()
    failed: bool = False
    """Nothing brings it back: the learner ran out of restarts."""

    @property
    def stuck(self) -> bool:
        return self.failed or bool(self.restarts.waiting)


def _times(n: int) -> str:
    return f"{n} time" + ("" if n == 1 else "s")


def describe(part: Part) -> str:
    """How it died, e.g. "buffer pod restarted 2 times, last: OOMKilled, now CrashLoopBackOff"."""
    r = part.restarts
    said = []
    if r.workload:
        said.append(f"learner JobSet restarted {_times(r.workload)} (a pod or slice was lost; it resumes from "
                    "its last checkpoint, the buffer keeps its data)")
    if r.pods or (r.last_reason and not r.workload):
        said.append(f"{_PODS[part.name]} restarted {_times(r.pods)}")
    text = ", ".join(said)
    if r.last_reason:
        text += f", last: {r.last_reason}" if text else f"last stop: {r.last_reason}"
    if part.failed:
        text += ("; " if text else "") + "out of restarts"
    elif r.waiting:
        text += f", now {r.waiting}" if text else f"now {r.waiting}"
    return text


def summary(parts: Sequence[Part]) -> str:
    """Restarts per component, e.g. "restarts: learner 1, buffer 2 (last: OOMKilled), actors 0"."""
    items = [f"{p.name} {p.restarts.total}" + (f" (last: {p.restarts.last_reason})" if p.restarts.last_reason else "")
             for p in parts]
    return "restarts: " + ", ".join(items)


def _down_detail(part: Part, state: str) -> str:
    detail = describe(part)
    return f"{part.name} {state}" + (f": {detail}" if detail else "")


def health_conditions(parts: Sequence[Part], *, started: bool) -> tuple[Cond, Cond]:
    """(Degraded, Recovering) for these parts; ``started``: the job has run (trained, or was Running).

    A part down before the job ever ran, with no restart, is starting, not degraded; one down after
    it ran, or that has restarted, died and is coming back unless it is stuck."""
    down = [p for p in parts if p.down]
    stuck = [p for p in down if p.stuck]
    coming = [p for p in down if not p.stuck and (started or p.restarts.total > 0)]
    tally = summary(parts)
    if not down:
        degraded = Cond("Degraded", "False", "AllComponentsUp", f"all components are up; {tally}")
    elif not stuck and not coming:
        degraded = Cond("Degraded", "False", "Starting", f"starting: {', '.join(p.name for p in down)}; {tally}")
    else:
        reason = ("Failed" if stuck[0].failed else stuck[0].restarts.waiting) if stuck else "ComponentDown"
        states = [_down_detail(p, "down") for p in stuck] + [_down_detail(p, "coming back") for p in coming]
        degraded = Cond("Degraded", "True", reason, "; ".join(states) + f"; {tally}")
    if coming:
        recovering = Cond("Recovering", "True", "Restarting", "; ".join(_down_detail(p, "coming back") for p in coming))
    elif stuck:
        recovering = Cond("Recovering", "False", "Stuck",
                          "; ".join(_down_detail(p, "down") for p in stuck) + ": it does not come back by itself")
    else:
        recovering = Cond("Recovering", "False", "NothingToRecover", "no component is coming back from a failure")
    return degraded, recovering
