"""Group commit for an event loop: log positions made durable by one thread, awaited on the loop.

A Put on the buffer's event loop appends its records and then awaits ``Flusher.durable(position)``.
The flusher thread takes every position asked for since its last flush, runs one ``Wal.sync`` for
the furthest (one ``fdatasync`` covers them all) and wakes the loop once for the lot. So no thread
is held by a Put while the disk works, and Puts arriving during a flush share the next one.
"""

from __future__ import annotations

import asyncio
import threading

from stoker.buffer.wal import Wal
from stoker.buffer.wal_files import WalError
from stoker.buffer.wal_format import Position


class Flusher:
    """Owns one daemon thread; ``durable`` is called on ``loop``, ``stop`` from anywhere."""

    def __init__(self, wal: Wal, loop: asyncio.AbstractEventLoop):
        self.wal = wal
        self.loop = loop
        self._cond = threading.Condition()
        self._waiting: list[tuple[Position, asyncio.Future[None]]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="buffer-flush", daemon=True)
        self._thread.start()

    def durable(self, position: Position) -> asyncio.Future[None]:
        """A future that completes once ``position`` is on disk, or fails with ``WalError``."""
        future: asyncio.Future[None] = self.loop.create_future()
        if not self.wal.fsync:
            future.set_result(None)
            return future
        with self._cond:
            if self._stopping:
                future.set_exception(WalError("the buffer is shutting down"))
                return future
            self._waiting.append((position, future))
            if len(self._waiting) == 1:
                self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if not self._waiting:
                    return
                batch, self._waiting = self._waiting, []
            error: WalError | None = None
            try:
                self.wal.sync(max(position for position, _ in batch))
            except WalError as exc:
                error = exc
            try:
                self.loop.call_soon_threadsafe(_settle, batch, error)
            except RuntimeError:
                return  # the loop is closed: nobody is waiting any more

    def stop(self) -> None:
        """Flush what is asked for so far, then end the thread; later calls to ``durable`` fail."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()


def _settle(batch: list[tuple[Position, asyncio.Future[None]]], error: WalError | None) -> None:
    for _, future in batch:
        if future.done():  # its caller was cancelled
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
