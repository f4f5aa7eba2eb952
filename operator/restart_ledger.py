"""``status.restarts`` for the life of the job: pods that are gone still count.

Live pods show only their own containers' restarts: a pod evicted, preempted, lost with its node or
deleted takes its count along, and its replacement starts at 0. So each look folds the pod index
into a ledger kept in the RLJob's own status (``status.restartLedger``, which a restarted operator
reads back): the pods last seen with their counts, and per component what gone pods carried.

A pod that leaves (terminating, finished or gone) is one restart of its component when it was
replaced rather than removed on purpose:

- it says why (phase Failed, its own reason, a ``DisruptionTarget`` condition): always;
- it was just deleted: unless fewer pods are wanted now (scaled down, suspended), and only once a
  new pod of the same template replaces it (one of another template is a rollout: a spec edit).

The learner's pods, and any JobSet's, add none: a JobSet counts its group restarts itself
(``status.restarts``), a count kept here across a recreated JobSet (suspend, resume).

Pure: pod records and the ledger in, restarts and the next ledger out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from stoker.labels import parse_rfc3339
from stoker.operator.health import COMPONENT_OF_ROLE, LEARNER, Restarts, component_restarts
from stoker.operator.zombies import PodRecord
from stoker.status import CarriedRestarts, RestartLedger, SeenPod

PENDING_SECONDS = 300.0
"""How long a deleted pod waits for its replacement (a ReplicaSet makes one within seconds);
one still unreplaced was removed, not restarted."""

DELETED = "deleted"


def _key(pod: PodRecord) -> str:
    return pod.uid or pod.name


def _up(pod: PodRecord) -> bool:
    return not pod.deleting and not pod.health.finished


def _counts_replacements(component: str, jobset: bool) -> bool:
    return component != LEARNER and not jobset


def _why(pod: PodRecord | None) -> str:
    """Why a pod that leaves went, where it says so; "" when it was simply deleted (a deleted pod
    turns Failed too as its containers are killed, so Failed counts only before any deletion)."""
    if pod is None:
        return ""
    if pod.health.disruption:
        return pod.health.disruption
    if pod.health.failed and not pod.deleting:
        return pod.health.last_reason or "Failed"
    return ""


def read_ledger(raw: Any) -> RestartLedger:
    """The ledger in a status; an empty one if absent or not one (edited by hand): the counts in
    ``status.restarts`` still hold as the floor."""
    try:
        return RestartLedger.model_validate(raw or {})
    except ValidationError:
        return RestartLedger()


class _Tally:
    """Per component, what gone pods carried (``CarriedRestarts``), added to as pods leave."""

    def __init__(self, carried: Mapping[str, CarriedRestarts]):
        self.by = dict(carried)

    def add(self, component: str, n: int, reason: str = "", at: str = "") -> None:
        entry = self.by.get(component) or CarriedRestarts()
        update: dict[str, object] = {"count": entry.count + n}
        if reason and (at, reason) >= (entry.last_at, entry.last_reason):  # RFC 3339 UTC strings sort by time
            update |= {"last_reason": reason, "last_at": at}
        self.by[component] = entry.model_copy(update=update)

    def get(self, component: str) -> CarriedRestarts:
        return self.by.get(component) or CarriedRestarts()


def track_restarts(
    pods: Iterable[PodRecord] | None,
    ledger: RestartLedger,
    *,
    jobset_restarts: int,
    wanted: Mapping[str, int],
    now: datetime,
    floor: Mapping[str, int] | None = None,
) -> tuple[dict[str, Restarts], RestartLedger]:
    """Restarts per component, and the ledger to keep, from one job's pod records (None: the index
    could not be read, so the pods last seen stand in for them) and its ledger from the last look.

    ``wanted``: pods each component should have now (its workload's replicas; absent: unknown);
    ``floor``: the counts reported last time, which nothing takes back."""
    stamp = now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    tally = _Tally(ledger.carried)
    # A recreated JobSet starts its count at 0 again: what the last one counted is kept.
    jobset_carried = ledger.jobset_carried + (ledger.jobset_seen if jobset_restarts < ledger.jobset_seen else 0)
    unseen: Counter[str] = Counter()
    if pods is None:
        seen, live = list(ledger.pods), []
        for s in seen:
            unseen[s.component] += s.restarts
    else:
        records = {_key(p): p for p in pods if p.role in COMPONENT_OF_ROLE}
        seen, live = _fold(records, ledger, tally, wanted, now, stamp), list(records.values())

    out = component_restarts(live)
    for component, r in out.items():
        workload = jobset_restarts + jobset_carried if component == LEARNER else 0
        shortfall = (floor or {}).get(component, 0) - (tally.get(component).count + unseen[component] + r.pods + workload)
        if shortfall > 0:  # a ledger lost, or older than the count: the count stays
            tally.add(component, shortfall)
        carried = tally.get(component)
        stops = [(carried.last_at, carried.last_reason)] if carried.last_reason else []
        if r.last_reason:
            stops.append((_finished(live, component, r.last_reason), r.last_reason))
        out[component] = Restarts(pods=carried.count + unseen[component] + r.pods, workload=workload,
                                  last_reason=max(stops)[1] if stops else "", waiting=r.waiting)
    kept = RestartLedger(
        carried={c: tally.get(c) for c in sorted(tally.by)},
        jobset_seen=jobset_restarts,
        jobset_carried=jobset_carried,
        pods=sorted(seen, key=lambda s: s.uid),
    )
    return out, kept


def _finished(live: list[PodRecord], component: str, reason: str) -> str:
    """When a live pod of ``component`` last stopped for ``reason`` (to order it against gone pods')."""
    return max((p.health.last_finished for p in live
                if COMPONENT_OF_ROLE.get(p.role) == component and p.health.last_reason == reason), default="")


def _fold(records: Mapping[str, PodRecord], ledger: RestartLedger, tally: _Tally, wanted: Mapping[str, int],
          now: datetime, stamp: str) -> list[SeenPod]:
    """Count the pods that left since the last look into ``tally``; the pods to remember."""
    before = {s.uid: s for s in ledger.pods}
    up_before = Counter(s.component for s in ledger.pods if s.up)
    left: dict[str, str] = {s.uid: s.left for s in ledger.pods if s.left}  # deleted, awaiting a replacement
    deleted: dict[str, list[SeenPod]] = {}
    gone: list[SeenPod] = []
    for s in ledger.pods:
        pod = records.get(s.uid)
        if s.up and (pod is None or not _up(pod)) and _counts_replacements(s.component, s.jobset):
            if why := _why(pod):
                tally.add(s.component, 1, why, stamp)
            else:
                deleted.setdefault(s.component, []).append(s)
        if pod is None:
            tally.add(s.component, s.restarts, s.last_reason, s.last_at)  # its restarts stay counted
            gone.append(s)
    for key, pod in records.items():  # died before the operator ever saw it up
        component = COMPONENT_OF_ROLE[pod.role]
        if key not in before and not _up(pod) and _counts_replacements(component, pod.jobset) and (why := _why(pod)):
            tally.add(component, 1, why, stamp)
    for component, pods in deleted.items():
        # Pods removed on purpose: as many as the component had above what it wants now.
        surplus = max(0, up_before[component] - wanted.get(component, up_before[component]))
        for s in sorted(pods, key=lambda s: s.uid)[surplus:]:
            left[s.uid] = stamp

    info = {**before, **{k: _seen(p) for k, p in records.items()}}
    newcomers = sorted((p for k, p in records.items() if k not in before and _up(p)
                        and _counts_replacements(COMPONENT_OF_ROLE[p.role], p.jobset)), key=_key)
    for uid, since in sorted(left.items(), key=lambda kv: (kv[1], kv[0])):
        s = info[uid]
        mine = [p for p in newcomers if COMPONENT_OF_ROLE[p.role] == s.component]
        same = next((p for p in mine if not p.revision or not s.revision or p.revision == s.revision), None)
        if same is not None:
            tally.add(s.component, 1, DELETED, since)
            newcomers.remove(same)
        elif mine or (now - parse_rfc3339(since)).total_seconds() > PENDING_SECONDS:
            pass  # replaced from another template (a rollout), or not replaced: removed
        else:
            continue
        del left[uid]

    seen = [_seen(p).model_copy(update={"left": left.get(k, "")}) for k, p in records.items()]
    # A deleted pod that is gone but not replaced yet stays until it is; its restarts are carried already.
    seen += [s.model_copy(update={"restarts": 0, "up": False, "last_reason": "", "last_at": "", "left": left[s.uid]})
             for s in gone if s.uid in left]
    return seen


def _seen(pod: PodRecord) -> SeenPod:
    return SeenPod(uid=_key(pod), component=COMPONENT_OF_ROLE[pod.role], restarts=pod.health.restarts, up=_up(pod),
                   revision=pod.revision, jobset=pod.jobset, last_reason=pod.health.last_reason,
                   last_at=pod.health.last_finished)
