"""Admission control: the AReaL credit rule and the operator's admission scale.

Admission (the AReaL rule, counted in groups)::

    credit = (max_staleness + version + 1) * batch_groups - (accepted + in_flight)

where ``accepted`` = groups committed so far plus complete groups waiting or leased (dropped groups
do not count: their work must be redone), and ``in_flight`` = credit granted whose group has not
completed yet, held per actor process (``CreditLedger``) so a dead actor's comes back. A group whose oldest model token has version ``v_old`` is stale, and dropped,
once ``version - v_old > max_staleness``.

The operator can tighten admission with a scale ``s`` in (0, 1] (``AdmissionScale``, a file it
writes). It scales the rule's allowance of untrained groups, not what is left of it::

    allowance   = (max_staleness + version + 1) * batch_groups - min(committed, version * batch_groups)
    outstanding = ready + leased + in_flight
    credit      = floor(s * allowance) - outstanding

(``min``: a batch the learner commits without making an update leaves the version where it was, so
its groups must not use up credit; ``version * batch_groups`` is what the updates so far consumed.)

With ``s = 1`` this is the rule above. Scaling the remainder instead would let repeated small
Acquires creep back to nearly the full allowance (each gets a fraction of what is left), so the
operator's halving would barely reduce how far actors run ahead of the learner.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("stoker.buffer")

Clock = Callable[[], float]


ADMISSION_SCALE_KEY = "admissionScale"
# gRPC metadata key: the id of one actor process, the same on all its calls (``CreditLedger``).
INCARNATION_KEY = "stoker-incarnation"


def parse_admission_scale(text: str) -> float:
    """``{"admissionScale": x}`` -> x; ``ValueError`` naming the problem unless 0 < x <= 1."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(document, dict) or ADMISSION_SCALE_KEY not in document:
        raise ValueError(f'expected an object {{"{ADMISSION_SCALE_KEY}": x}} with 0 < x <= 1')
    value = document[ADMISSION_SCALE_KEY]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:  # NaN fails too
        raise ValueError(f"{ADMISSION_SCALE_KEY}: got {value!r}; expected a number in (0, 1]")
    return float(value)


class AdmissionScale:
    """The operator's admission scale, re-read from its JSON file whenever the file changes.

    The file is a mounted ConfigMap, which Kubernetes replaces by swapping a symlink, so a change
    shows as a new (mtime, inode, size) of the file the path resolves to; ``maybe_reload`` looks at
    most once per ``interval`` seconds of ``clock``. A missing, unreadable or malformed file means
    scale 1 (the buffer's own rule, untightened), logged once per distinct problem: the operator's
    control is advisory and must never stop the buffer or starve the actors.
    """

    def __init__(self, path: str | Path | None, *, clock: Clock = time.monotonic, interval: float = 1.0):
        self.path = Path(path) if path else None
        self.clock = clock
        self.interval = interval
        self.value = 1.0
        self._stamp: tuple[int, int, int] | None = None
        self._problem: str | None = None
        self._next_check = -math.inf
        self._lock = threading.Lock()

    def maybe_reload(self) -> float:
        """The scale, after re-reading the file if ``interval`` has passed and it changed."""
        if self.path is None or self.clock() < self._next_check:
            return self.value
        if not self._lock.acquire(blocking=False):
            return self.value  # another thread is looking at the file right now
        try:
            self._check()
        finally:
            self._lock.release()
        return self.value

    def reload(self) -> float:
        """Look at the file now, whatever the interval; returns the scale in use."""
        if self.path is not None:
            with self._lock:
                self._check()
        return self.value

    def _check(self) -> None:
        assert self.path is not None
        self._next_check = self.clock() + self.interval
        try:
            info = os.stat(self.path)
            stamp = (info.st_mtime_ns, info.st_ino, info.st_size)
            if stamp == self._stamp:
                return
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            self._stamp = None  # look again next time
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._use(1.0, f"cannot read ({reason})")
            return
        self._stamp = stamp
        try:
            self._use(parse_admission_scale(text), None)
        except ValueError as exc:
            self._use(1.0, str(exc))

    def _use(self, scale: float, problem: str | None) -> None:
        if problem is not None:
            if problem != self._problem:
                log.warning("admission file %s: %s; using admission scale 1", self.path, problem)
        elif scale != self.value or self._problem is not None:
            log.info("admission scale %g -> %g (from %s)", self.value, scale, self.path)
        self.value, self._problem = scale, problem


class CreditLedger:
    """Admission credit granted and not yet used (``in_flight``), held per actor incarnation.

    An incarnation is one actor process: its client sends the same random id with every call
    (``INCARNATION_KEY``). A group's credit comes back when the group completes or the actor
    releases it; a dead actor does neither, so its credit also comes back when the same actor id
    acquires as a new incarnation (it was restarted) or when the incarnation has been silent for
    the expiry (gone for good: scaled down, or replaced under another name). Otherwise each actor
    death would lower for good how many episodes the actors may have out, and the run starves.

    Calls without an incarnation (older clients, in-process callers) share one anonymous hold that
    never expires: the rule before incarnations existed.
    """

    def __init__(self) -> None:
        self.total = 0
        self._holds: dict[str, _Hold] = {}  # incarnation ("" anonymous) -> its hold

    def register(self, actor_id: str, incarnation: str, now: float) -> int:
        """``incarnation`` of ``actor_id`` is calling: the first call of a new one ends the holds
        of that actor's earlier incarnations (it was restarted). Returns the groups given back."""
        returned = 0
        if incarnation and incarnation not in self._holds:
            for old in [i for i, hold in self._holds.items() if i and hold.actor_id == actor_id]:
                returned += self._end(old)
            if returned:
                log.info("actor %s restarted: its previous process's credit for %d groups given back", actor_id, returned)
        self._holds.setdefault(incarnation, _Hold(actor_id, 0, now)).seen = now
        return returned

    def grant(self, incarnation: str, groups: int, now: float) -> None:
        """Record ``groups`` granted to ``incarnation`` (after ``register``)."""
        hold = self._holds[incarnation]
        hold.groups += groups
        hold.seen = now
        self.total += groups

    def give_back(self, incarnation: str, groups: int, now: float) -> None:
        """``groups`` of ``incarnation``'s credit will never be used (Release, or a group complete)."""
        hold = self._holds.get(incarnation)
        if hold is None:
            return  # its credit was given back already (superseded, expired) or never granted here
        taken = min(groups, hold.groups)
        hold.groups -= taken
        hold.seen = now
        self.total -= taken

    def seen(self, incarnation: str, now: float) -> None:
        """``incarnation`` is alive (it sent a Put): its hold does not expire yet."""
        hold = self._holds.get(incarnation)
        if hold is not None:
            hold.seen = now

    def expire(self, now: float, silence: float) -> list[tuple[str, int]]:
        """End the holds of incarnations silent for more than ``silence`` seconds; returns
        ``(actor id, groups given back)`` for each that held credit."""
        ended = []
        for incarnation in [i for i, hold in self._holds.items() if i and now - hold.seen > silence]:
            actor_id = self._holds[incarnation].actor_id
            groups = self._end(incarnation)
            if groups:
                ended.append((actor_id, groups))
        return ended

    def held(self, incarnation: str) -> int:
        """The groups of credit ``incarnation`` holds."""
        hold = self._holds.get(incarnation)
        return 0 if hold is None else hold.groups

    def _end(self, incarnation: str) -> int:
        hold = self._holds.pop(incarnation)
        self.total -= hold.groups
        return hold.groups


@dataclass
class _Hold:
    actor_id: str
    groups: int  # credit granted and not yet given back
    seen: float  # the incarnation's last call, on the buffer's clock
