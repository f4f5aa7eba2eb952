"""Where a process's wall time goes, by sampling its threads' Python stacks (``stoker run --profile``).

Every ``INTERVAL_SECONDS`` a daemon thread reads ``sys._current_frames()`` and counts, per thread,
the innermost ``DEPTH`` frames of each stack. The counts are wall time, not CPU: a thread blocked in
a socket read or waiting for admission shows up where it waits, which is what tells a
latency-bound actor (waiting on the sampler, the environment, the buffer) from a busy one. The
summary is rewritten every ``WRITE_SECONDS`` and at exit, so a process killed outright still left
one. Costs ~1 % of a core: a stack walk of a few threads 100 times a second.

``stoker run --profile`` names a folder in ``PROFILE_ENV``; each Stoker process started with it
writes ``<command>-<pid>.txt`` there (``stoker.cli``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

PROFILE_ENV = "STOKER_PROFILE_DIR"
INTERVAL_SECONDS = 0.01
WRITE_SECONDS = 10.0
DEPTH = 6  # innermost frames kept per stack: enough to name the call a thread is in and who made it
TOP_STACKS = 8  # per thread, in the summary
THREAD_NAME = "stoker-profile"


def stack_key(frame: FrameType | None, depth: int = DEPTH) -> str:
    """``file:function:line`` of the innermost ``depth`` frames, innermost first."""
    parts: list[str] = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(parts)


def thread_family(name: str) -> str:
    """A thread's name without the counter Python and executors append (``asyncio_3`` ->
    ``asyncio``, ``Thread-7 (_run)`` -> ``Thread (_run)``): pools add up as one."""
    head, _, rest = name.partition(" ")
    return (head.rstrip("0123456789").rstrip("-_") or head) + (f" {rest}" if rest else "")


class StackSampler:
    """Counts of each thread family's stacks, sampled from a daemon thread."""

    def __init__(self, path: Path, title: str, interval: float = INTERVAL_SECONDS, write_every: float = WRITE_SECONDS):
        self.path, self.title, self.interval, self.write_every = path, title, interval, write_every
        self.counts: Counter[tuple[str, str]] = Counter()
        self.samples = 0
        self.errors = 0  # stacks that could not be read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self.write()

    def sample(self) -> None:
        me = threading.get_ident()
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        frames = sys._current_frames()
        with self._lock:
            self.samples += 1
            for ident, frame in frames.items():
                if ident == me:
                    continue
                try:
                    key = stack_key(frame)
                except (AttributeError, ValueError):
                    # Another thread's frames change under the walk (a frame torn down between
                    # two reads); a sample lost is cheaper than a profiler thread that dies.
                    self.errors += 1
                    continue
                self.counts[(thread_family(names.get(ident, "unnamed")), key)] += 1

    def summary(self) -> str:
        """Per thread family (busiest first): its samples, and its top stacks with their shares."""
        with self._lock:
            counts = dict(self.counts)
            samples = self.samples
        per_family: Counter[str] = Counter()
        for (family, _), n in counts.items():
            per_family[family] += n
        lines = [f"{self.title}", f"{samples} samples every {self.interval * 1000:.0f} ms "
                 f"({samples * self.interval:.0f} s of wall time); shares are of each thread family's samples"]
        # The main thread first (an actor's event loop, the learner's loop), then by samples.
        for family, total in sorted(per_family.items(), key=lambda item: (item[0] != "MainThread", -item[1])):
            lines.append(f"\n## {family}: {total} samples")
            stacks = sorted(((n, stack) for (f, stack), n in counts.items() if f == family), reverse=True)
            for n, stack in stacks[:TOP_STACKS]:
                lines.append(f"{100 * n / total:5.1f} %  {stack}")
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".tmp")
            partial.write_text(self.summary())
            partial.replace(self.path)
        except OSError:  # a full or vanished run directory: the profile is not worth failing for
            pass

    def _run(self) -> None:
        written = time.monotonic()
        while not self._stop.wait(self.interval):
            self.sample()
            if time.monotonic() - written >= self.write_every:
                written = time.monotonic()
                self.write()


def profile_from_env(command: str) -> StackSampler | None:
    """A sampler writing ``<PROFILE_ENV>/<command>-<pid>.txt``, started, if the variable names a folder."""
    folder = os.environ.get(PROFILE_ENV)
    if not folder:
        return None
    title = f"stoker {command} (pid {os.getpid()}): {' '.join(sys.argv)[:400]}"
    return StackSampler(Path(folder) / f"{command}-{os.getpid()}.txt", title).start()
