"""A bound on the wall time of one of ``stoker bench``'s device programs.

A call into the device cannot be cancelled: a program past its bound is reported as unfinished,
with the phase it was in, and left to its thread. The bench then runs nothing more (the device
may still be busy with it) and the process exits without waiting for it (``bench.main``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
HEARTBEAT_SECONDS = 30.0  # a "still running" line this often, so a slow program is not taken for a hang


@dataclass
class Phase:
    """What a program's run is doing now ("making inputs", "first run", "timed run 2 of 5")."""

    now: str = "starting"
    started: float = field(default_factory=time.monotonic)

    def enter(self, what: str) -> None:
        self.now, self.started = what, time.monotonic()


class Unfinished(Exception):
    """A program still running when its bound ran out."""

    def __init__(self, what: str, phase: str, seconds: float, bound: float) -> None:
        super().__init__(f"{what}: still in its {phase} after {seconds:.0f} s (bound {bound:.0f} s)")
        self.what, self.phase, self.seconds, self.bound = what, phase, seconds, bound


def bounded(work: Callable[[], T], bound: float, what: str, phase: Phase, progress: Callable[[str], None],
            heartbeat: float = HEARTBEAT_SECONDS) -> T:
    """``work()``'s result, or its exception, if it ends within ``bound`` seconds; else ``Unfinished``.

    ``work`` runs in a daemon thread, so a device call that never returns cannot keep the process
    alive; every ``heartbeat`` seconds meanwhile ``progress`` hears what it is doing."""
    outcome: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            outcome["error"] = exc
        finally:
            done.set()

    started = time.monotonic()
    threading.Thread(target=target, name=f"bench {what}", daemon=True).start()
    while not done.wait(max(0.0, min(heartbeat, bound - (time.monotonic() - started)))):
        elapsed = time.monotonic() - started
        if elapsed >= bound:
            raise Unfinished(what, phase.now, elapsed, bound)
        progress(f"  {what}: {phase.now}, still running after {elapsed:.0f} s (bound {bound:.0f} s)")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
