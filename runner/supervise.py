"""Restarting the children of ``stoker run`` that die, as a cluster's kubelet would.

A child that dies -- an actor, the buffer, the learner, a rollout server -- is restarted after a
backoff (1 s, doubling to 30 s), within a budget per child (``--max-restarts``, 5 by default,
counted over the last 10 minutes); a message names what died, how (its exit code or signal) and
the last lines of its log. A child that keeps dying spends its budget and stops the run with its
log tail. What each one picks up on its restart is its own: the learner restores its latest
checkpoint (a new session, so the buffer hands its uncommitted leases out again), the buffer
replays its write-ahead log onto the same socket, actors reconnect and start new episodes (the
dead one's process group, sandboxes included, is killed; episodes it had in flight are never
submitted, and their incomplete groups stay behind in the buffer; the admission credit it held
comes back when the restarted actor calls as a new process, or after the buffer's
``group_timeout_seconds`` of silence: ``buffer/admission.py``, ``CreditLedger``).

A death the full disk caused is not restarted and spends no budget: it would die the same way.
``check`` raises ``DiskFull`` for it (``runner/diskfull.py`` tells one) and the run stops.

The restart policy is a pure function of the deaths so far and the clock (``restart_delay``); the
``Supervisor`` applies it to ``Unit``\\s, each the processes that die and restart together (one
actor; the learner's JAX processes; a rollout server's).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stoker.runner.children import STOP_GRACE_SECONDS, Child, wait_for_ready_file
from stoker.runner.diskfull import DiskFull, death_by_full_disk

Clock = Callable[[], float]


@dataclass(frozen=True)
class RestartPolicy:
    """How often a dead child is restarted, and how soon.

    The ``n``-th death within ``window_seconds`` waits ``min(max_backoff, initial_backoff *
    2**(n-1))`` seconds before the restart; a death beyond ``max_restarts`` within the window stops
    the run. ``max_restarts`` 0: no restarts, the first death stops the run."""

    max_restarts: int = 5
    window_seconds: float = 600.0
    initial_backoff: float = 1.0
    max_backoff: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts {self.max_restarts}: expected >= 0")
        if self.window_seconds <= 0 or self.initial_backoff < 0 or self.max_backoff < self.initial_backoff:
            raise ValueError(f"{self}: expected window > 0 and 0 <= initial_backoff <= max_backoff")


def recent(policy: RestartPolicy, deaths: Sequence[float], now: float) -> int:
    """How many of ``deaths`` (times on the same clock as ``now``) fall within the policy's window."""
    return sum(1 for t in deaths if now - t < policy.window_seconds)


def restart_delay(policy: RestartPolicy, deaths: Sequence[float], now: float) -> float | None:
    """Seconds to wait before restarting a child whose deaths so far, this one included, happened
    at ``deaths``; None when its budget is spent (more than ``max_restarts`` within the window)."""
    n = recent(policy, deaths, now)
    if n == 0:
        raise ValueError("restart_delay: no death within the window to restart from")
    if n > policy.max_restarts:
        return None
    return min(policy.max_backoff, policy.initial_backoff * 2.0 ** (n - 1))


def describe_exit(code: int) -> str:
    """``exit code 3``, or ``killed by SIGKILL`` for a negative (Popen's signal) code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class Unit:
    """Processes that die and restart together: one actor, the buffer, the learner's JAX
    processes, a rollout server's. ``envs`` gives each member's environment for a (re)start, in
    the order of ``children`` (a JAX group meets at a fresh coordinator port each time);
    ``ready``: the file a server writes once it serves, and which member writes it."""

    name: str
    children: list[Child]
    envs: Callable[[], list[dict[str, str]]]
    ready: tuple[Path, Child] | None = None
    may_finish: bool = False  # the learner: exit 0 is the run's end, not a death
    deaths: list[float] = field(default_factory=list)
    due: float | None = None  # when its pending restart is due; None: running

    def dead_member(self) -> Child | None:
        for child in self.children:
            code = child.returncode
            if code is not None and (code != 0 or not self.may_finish):
                return child
        return None

    def relaunch(self) -> None:
        """Start every member again (all stopped before); for a server, wait until it serves."""
        if self.ready is not None:
            self.ready[0].unlink(missing_ok=True)
        for child, env in zip(self.children, self.envs(), strict=True):
            child.start(env)
        if self.ready is not None:
            path, server = self.ready
            try:
                wait_for_ready_file(path, server)
            except RuntimeError:
                if server.running:
                    raise  # alive and not serving: a hang no restart mends
                # Died before serving: a death like any other, seen by the next check.


@dataclass
class Supervisor:
    """Watches units, restarts the ones that die per ``policy``; ``check`` says when one is spent."""

    policy: RestartPolicy
    units: list[Unit] = field(default_factory=list)
    clock: Clock = time.monotonic
    say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)
    run_dir: Path | None = None  # whose filesystem, once full, makes a death final (runner/diskfull.py)

    def check(self) -> str | None:
        """Restart what is due, note what died; the reason to stop the run when a unit has died
        more often than its budget allows, else None. Raises ``DiskFull`` for a death the full
        disk caused: a restart would die the same way, so it spends no budget."""
        for unit in self.units:
            now = self.clock()
            if unit.due is not None:
                if now >= unit.due:
                    unit.due = None
                    unit.relaunch()
                    self.say(f"stoker run: {unit.name} restarted (restart {len(unit.deaths)})")
                continue
            dead = unit.dead_member()
            if dead is None:
                continue
            assert dead.returncode is not None
            how = describe_exit(dead.returncode)
            for child in unit.children:  # its peers go too (a JAX group cannot continue), and its sandboxes
                child.stop(STOP_GRACE_SECONDS)
            full = death_by_full_disk(dead.name, dead.returncode, dead.tail(), self.run_dir)
            if full is not None:
                raise DiskFull(f"{full}\n({dead.name} died ({how}); its log: {dead.log_path})")
            unit.deaths.append(now)
            delay = restart_delay(self.policy, unit.deaths, now)
            if delay is None:
                count = recent(self.policy, unit.deaths, now)
                return (f"{dead.name} died ({how}), {count} time(s) within {self.policy.window_seconds / 60:g} minutes "
                        f"(--max-restarts {self.policy.max_restarts}); stopping the run.\n"
                        f"last lines of {dead.log_path}:\n{dead.tail()}")
            unit.due = now + delay
            count = recent(self.policy, unit.deaths, now)
            budget = f"restart {count} of {self.policy.max_restarts} within {self.policy.window_seconds / 60:g} minutes"
            self.say(f"stoker run: {dead.name} died ({how}); restarting {unit.name} in {delay:g} s ({budget})\n"
                     f"last lines of {dead.log_path}:\n{dead.tail(5)}")
        return None

    def wait(self, child: Child, most: float) -> None:
        """Wait up to ``most`` seconds, less when a restart is due sooner; return at once when
        ``child`` (the learner) exits."""
        due = self.next_due()
        timeout = most if due is None else min(most, due)
        if child.running:
            child.wait(timeout)
        else:
            time.sleep(timeout)  # a poll interval: the child is down until its restart is due

    def next_due(self) -> float | None:
        """Seconds until the earliest pending restart, None when none is pending."""
        pending = [unit.due for unit in self.units if unit.due is not None]
        return None if not pending else max(0.0, min(pending) - self.clock())

    def summary(self) -> str:
        """A line ``restarts: actor-0 1, buffer 2`` (after a newline), or empty when nothing was restarted."""
        counts = [f"{unit.name} {len(unit.deaths)}" for unit in self.units if unit.deaths]
        return f"\nrestarts: {', '.join(counts)}" if counts else ""


def pin_port(argv: list[str], address: str) -> list[str]:
    """``argv`` with ``--port 0`` replaced by the port ``address`` (``host:port``) bound, so a
    restarted server listens where its clients already dial; unchanged for a unix socket."""
    if "--port" not in argv or address.startswith("unix:"):
        return argv
    at = argv.index("--port") + 1
    return [*argv[:at], address.rsplit(":", 1)[1], *argv[at + 1:]] if argv[at] == "0" else argv
