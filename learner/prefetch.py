"""Fetch the next batch from the buffer while the current one trains.

Sampling is a gRPC round trip plus decoding, a few percent of a step on a small model; done in
line it is time the accelerator waits, which caps the learner's duty cycle below 1 even when the
buffer is full. One batch is fetched ahead, no more: every batch held ahead is one more policy
version of staleness at train time. A batch fetched but never trained (the learner stops) is
simply not committed, so the buffer hands its groups out again when the lease ends -- the same
guarantee as a learner that dies mid-step.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol


class Sampler(Protocol):
    def sample(self, max_groups: int, min_groups: int, timeout: float) -> Any: ...


_IDLE = object()  # the buffer had no batch within the timeout


class Prefetcher:
    """A background thread that keeps one sampled batch ready.

    ``get`` returns the next batch, or None when the buffer had none within ``timeout`` (so the
    caller can report itself idle and check for a stop); an error raised by ``sample`` is raised
    again from ``get``.
    """

    def __init__(self, source: Sampler, *, max_groups: int, min_groups: int, timeout: float):
        self._source = source
        self._max_groups, self._min_groups, self._timeout = max_groups, min_groups, timeout
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self._source.sample(self._max_groups, self._min_groups, self._timeout)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which decides
                self._hand_over(exc)
                return
            empty = batch is None or not getattr(batch, "batch_id", "") or not batch.groups
            self._hand_over(_IDLE if empty else batch)

    def _hand_over(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def get(self) -> Any:
        """The next batch (None when the buffer had none in time)."""
        try:
            item = self._ready.get(timeout=self._timeout + 1.0)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return None if item is _IDLE else item

    def close(self, wait: float | None = None) -> None:
        """Stop fetching; a batch already fetched is left uncommitted for redelivery. Waits for the
        thread at most ``wait`` seconds (default: one Sample's timeout and a margin); a Sample still
        retrying against an unreachable buffer is left to the daemon thread."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=self._timeout + 5.0 if wait is None else wait)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
