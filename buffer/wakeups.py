"""Long polls on the buffer's event loop: calls waiting for its state, woken from any thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Wakeups:
    """The waiting calls of one kind (Samples for groups, Acquires for credit). The core calls
    ``wake`` with its lock held, from whichever thread changed the state, so waking never blocks:
    off the loop's thread it is handed to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._loop_thread_id = threading.get_ident()
        self._waiting: list[tuple[int, asyncio.Event]] = []  # (the level that wakes it, its event)

    @contextmanager
    def waiting(self, level: int = 0) -> Iterator[asyncio.Event]:
        """An event set by every ``wake(n)`` with ``n >= level``. Register before the first look
        at the state, so a change made by another thread in between still wakes the call."""
        entry = (level, asyncio.Event())
        self._waiting.append(entry)
        try:
            yield entry[1]
        finally:
            self._waiting.remove(entry)

    def wake(self, level: int = 0) -> None:
        if not self._waiting:
            return
        if threading.get_ident() == self._loop_thread_id:
            self._wake(level)
        else:
            self.loop.call_soon_threadsafe(self._wake, level)

    def _wake(self, level: int) -> None:
        for wanted, event in self._waiting:
            if level >= wanted:
                event.set()


async def wait_for_wake(event: asyncio.Event, seconds: float) -> None:
    """Wait until ``event`` is set or ``seconds`` pass, whichever comes first."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        pass
