"""Group commit for the write-ahead log: one flush shared by every thread waiting at that moment.

A thread that needs a position durable either finds it already flushed, waits for the flush under
way (which may cover it), or leads the next one: it flushes everything written so far, so every
writer that arrived meanwhile returns after that one flush. Concurrent Puts pay for one
``fdatasync`` between them. ``exclusive`` keeps leaders off while the log swaps its file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from stoker.buffer.wal_format import Position


class GroupCommit:
    """How far the log is durable (``synced``), and who flushes next. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._leading = False  # a thread is flushing (or the log is swapping its file)
        self.synced: Position = (0, 0)  # set directly only by the log, when it starts a segment

    def sync(self, position: Position, flush: Callable[[Position], Position]) -> None:
        """Return once ``synced`` covers ``position``. A leader calls ``flush(position)``, which
        makes at least ``position`` durable and returns how far it got (or raises, and waiters
        elect another leader)."""
        while True:
            with self._cond:
                while self.synced < position and self._leading:
                    self._cond.wait()
                if self.synced >= position:
                    return
                self._leading = True
            # This thread leads: one flush covers everything written so far, for every waiter.
            flushed: Position | None = None
            try:
                flushed = flush(position)
            finally:
                with self._cond:
                    if flushed is not None and flushed > self.synced:
                        self.synced = flushed
                    self._leading = False
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """No flush runs inside: the log may change the file a leader would flush."""
        with self._cond:
            while self._leading:
                self._cond.wait()
            self._leading = True  # keep group-commit leaders off the fd while it changes
        try:
            yield
        finally:
            with self._cond:
                self._leading = False
                self._cond.notify_all()
