"""The learner's step programs compiled before it needs them, on a background thread.

``Trainer.grad`` compiles once per bucket shape, by default when a batch first needs that shape:
the first step waits for it, and a longer bucket met mid-run stalls the loop (on the v5e 4-7 s
each on a fresh host, issue 50). Compiled ahead of time, each program lands in the persistent
compilation cache, where the step's own call then finds it (~0.04 s against 1.2 s for the tests'
tiny model on this CPU). The thread runs while the learner waits for its first batch (actors
starting and sampling); a step waits only for the buckets it uses. Only on accelerators: on a
CPU the compile would take the cores the step and the actors share."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from stoker.compilation_cache import cache_enabled

log = logging.getLogger(__name__)


def wanted(platform: str) -> bool:
    """Whether to compile ahead on this platform: not the CPU, and a persistent cache on (without
    one, compiling ahead would not help the step's own call)."""
    return platform != "cpu" and cache_enabled()


class AheadOfTime:
    """``grad`` of every bucket, shortest first (the one a run meets first), ``apply`` after the
    first and ``accumulate`` last, compiled on a daemon thread."""

    def __init__(self, trainer: Any, rows: dict[int, int]):
        self.trainer, self.rows = trainer, dict(rows)
        self.ready = {length: threading.Event() for length in rows}  # its grad (and what comes before) done
        self.compiled: list[str] = []
        self._thread = threading.Thread(target=self._run, name="precompile", daemon=True)

    def start(self) -> AheadOfTime:
        self._thread.start()
        return self

    def finish(self) -> None:
        """Wait for the thread: a process must not exit while it is inside the compiler (the
        interpreter's shutdown under a running compile aborts the process)."""
        self._thread.join()

    def wait_for(self, lengths: Iterable[int]) -> None:
        """Until the programs of these buckets are compiled (or compiling them failed)."""
        for length in lengths:
            if length in self.ready:
                self.ready[length].wait()

    def _run(self) -> None:
        started = time.monotonic()
        lengths = sorted(self.rows)
        try:
            for index, length in enumerate(lengths):
                programs = self.trainer.programs(self.rows[length], length)
                wanted = ["grad", "apply"] if index == 0 else ["grad"]
                if index == len(lengths) - 1:
                    wanted.append("accumulate")
                for name in wanted:
                    function, arguments = programs[name]
                    function.lower(*arguments).compile()
                    self.compiled.append(f"grad {self.rows[length]}x{length}" if name == "grad" else name)
                self.ready[length].set()
        except Exception as exc:  # noqa: BLE001 - an optimisation: a step compiles what is missing
            log.warning("compiling the step programs ahead failed (%r); each compiles when first needed", exc)
        finally:
            for event in self.ready.values():
                event.set()
        log.info("step programs compiled ahead in %.1f s: %s", time.monotonic() - started, ", ".join(self.compiled))


def start(trainer: Any, rows: dict[int, int], platform: str) -> AheadOfTime | None:
    """An ``AheadOfTime`` compile running where it pays (``wanted``); None otherwise."""
    return AheadOfTime(trainer, rows).start() if wanted(platform) else None
