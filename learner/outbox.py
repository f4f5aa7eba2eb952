"""The learner's work after a step -- commit the batch, publish weights, report the version --
done on one background thread, in order, so the training thread goes straight to the next batch.

Done in line, that work is time the accelerator waits even when the buffer is full: 4 % of the
loop's wall time with a tiny model and an idle machine (``benchmarks/learner_duty.py``: duty cycle
0.957 in line, 0.985 with this), a fifth of the learner's samples under py-spy on the FrozenLake
job, where encoding and fsyncing the weights and three RPCs compete with the actors for the CPU.

Tasks run one at a time, in the order sent: a version is reported to the buffer only after weights
at least that new are published (actors fetch what they are told exists), and commits reach the
buffer in training order. An error in a task is raised on the training thread at its next
``send`` or ``drain``, not lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Outbox:
    def __init__(self, name: str = "learner-outbox"):
        self._queue: list[Callable[[], object]] = []
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def send(self, task: Callable[[], object]) -> None:
        """Queue ``task`` to run after every task sent before it."""
        with self._cond:
            self._raise_error()
            if self._closed:
                raise RuntimeError("outbox is closed")
            self._queue.append(task)
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every task sent so far has run; raise the first error one of them raised."""
        with self._cond:
            self._cond.wait_for(self._settled)
            self._raise_error()

    def close(self, timeout: float | None = None) -> int:
        """Run what is queued, then stop the thread (errors are raised, as from ``drain``).

        With a ``timeout``, give up after that many seconds -- a buffer that is gone would keep a
        commit retrying for minutes -- and return how many tasks were abandoned (the one running is
        left to the daemon thread). A second close does nothing."""
        with self._cond:
            if self._closed:
                return 0
        abandoned = 0
        try:
            with self._cond:
                if not self._cond.wait_for(self._settled, timeout):
                    abandoned = len(self._queue) + int(self._busy)
                    self._queue.clear()
                self._raise_error()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if not abandoned:
                self._thread.join()
        return abandoned

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing: stop without running the rest or masking the first error.
        with self._cond:
            if self._closed:
                return
            self._queue.clear()
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _settled(self) -> bool:
        """Every task sent has run, or one failed (called holding the condition)."""
        return (not self._queue and not self._busy) or self._error is not None

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._queue.clear()
            raise error

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                task = self._queue.pop(0)
                self._busy = True
            try:
                task()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                with self._cond:
                    self._error = self._error or exc
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
