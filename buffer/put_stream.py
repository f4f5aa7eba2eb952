"""The client side of ``PutStream``: put trajectories one at a time, pipelined.

``PutStream.put`` returns at once with a future that completes when the buffer acknowledges the
trajectory as durable (fsynced), so an actor sends each episode as it finishes and never waits a
round trip per trajectory. Up to ``window`` trajectories are in flight; ``put`` blocks beyond that
(backpressure). What is waiting when the stream is ready to send goes out as one message, so a
producer faster than the network batches itself.

Failures: a batch the buffer refuses as full (or its volume as full) is sent again after the
buffer's hint; a broken stream is reopened with backoff (``RetryPolicy``) and every trajectory
not yet acknowledged is sent again, in order. The buffer stores each episode id once, so a
trajectory acknowledged or stored before the break is not stored twice. Only when the buffer stays
unreachable past the policy's deadline do the futures fail, with ``BufferUnavailableError``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from stoker.buffer.client_types import (
    AuthError,
    BufferUnavailableError,
    InvalidTrajectoryError,
    Rejection,
    encode_item,
    episode_id_of,
)
from stoker.buffer.wire import encode_put_stream_request
from stoker.v1 import buffer_pb2

if TYPE_CHECKING:  # only for the type: stoker.buffer.client imports this module
    from stoker.buffer.client import BufferClient

log = logging.getLogger("stoker.buffer.client")

OK, INVALID_ARGUMENT = grpc.StatusCode.OK.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]
RESEND = {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], grpc.StatusCode.UNAVAILABLE.value[0]}


@dataclass(eq=False)
class _Item:
    raw: bytes
    episode_id: str
    future: Future[None] = field(default_factory=Future)


@dataclass(eq=False)
class _Batch:
    sequence: int
    items: list[_Item]


class PutStream:
    """One ``PutStream`` call (reopened as needed) of a ``BufferClient``; thread-safe. Use
    ``BufferClient.put_stream()``; ``close()`` (or the ``with`` block) waits for every
    acknowledgement."""

    def __init__(self, client: BufferClient, *, window: int = 64, max_batch_trajectories: int = 64, max_batch_bytes: int = 4 << 20):
        self.client = client
        self.window = window
        self.max_batch_trajectories = max_batch_trajectories
        self.max_batch_bytes = max_batch_bytes
        self._method = client.channel.stream_stream(
            "/stoker.v1.Buffer/PutStream", request_serializer=None, response_deserializer=None
        )
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Item] = collections.deque()  # not sent on the current stream
        self._unacked: collections.OrderedDict[int, _Batch] = collections.OrderedDict()
        self._in_flight = 0  # items waiting or unacknowledged
        self._sequence = 0
        self._generation = 0  # bumped when a stream is abandoned: its request generator ends
        self._resume_at = 0.0  # after a refusal: send nothing before this (monotonic)
        self._coalesce = max_batch_trajectories  # halved when the buffer refuses a batch as too large
        self._closing = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="buffer-put-stream", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side

    def put(self, item: Any) -> Future[None]:
        """Queue one trajectory (an Episode, a wire Trajectory or its bytes); the future completes
        once it is durable (or was already stored), or raises ``InvalidTrajectoryError``."""
        queued = _Item(encode_item(item), episode_id_of(item))
        with self._cond:
            while self._in_flight >= self.window and self._failed is None:
                self._cond.wait()
            if self._failed is not None:
                raise self._failed
            if self._closing:
                raise RuntimeError("put on a closed PutStream")
            self._waiting.append(queued)
            self._in_flight += 1
            self._cond.notify_all()
        return queued.future

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything put so far is acknowledged; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._in_flight and self._failed is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Wait for every acknowledgement, then end the stream."""
        self.flush()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def __enter__(self) -> PutStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the stream's side

    def _requests(self, generation: int) -> Iterator[bytes]:
        """What the current stream sends: whatever waits, as one message, each time it can send."""
        while True:
            with self._cond:
                while True:
                    if generation != self._generation:
                        return
                    if self._closing and not self._in_flight:
                        return  # half-close: the server acknowledges what is left and ends the call
                    pause = self._resume_at - time.monotonic()
                    if self._waiting and pause <= 0:
                        break
                    self._cond.wait(pause if self._waiting else None)
                items: list[_Item] = []
                size = 0
                while self._waiting and len(items) < self._coalesce:
                    if items and size + len(self._waiting[0].raw) > self.max_batch_bytes:
                        break
                    items.append(self._waiting.popleft())
                    size += len(items[-1].raw)
                self._sequence += 1
                self._unacked[self._sequence] = _Batch(self._sequence, items)
                sequence = self._sequence
            yield encode_put_stream_request(sequence, self.client.client_id, [item.raw for item in items])

    def _run(self) -> None:
        attempt = 0
        broken_since: float | None = None
        while True:
            with self._cond:
                if self._closing and not self._in_flight:
                    return
                generation = self._generation
            try:
                call = self._method(self._requests(generation), metadata=self.client._metadata)
            except ValueError as exc:  # the client's channel was closed under the stream
                self._fail(BufferUnavailableError(f"buffer at {self.client.address}: PutStream: {exc}"))
                return
            try:
                for data in call:
                    attempt, broken_since = 0, None
                    self._acknowledge(buffer_pb2.PutStreamResponse.FromString(data))
                with self._cond:
                    if self._closing and not self._in_flight:
                        return
                error: grpc.RpcError | None = None
            except grpc.RpcError as exc:
                error = exc
            code = error.code() if error is not None else grpc.StatusCode.UNAVAILABLE
            self._resend_unacked()
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                self._fail(AuthError(error.details() if error is not None else ""))
                return
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                detail = error.details() if error is not None else ""
                self._fail(BufferUnavailableError(f"buffer at {self.client.address}: PutStream: {code.name}: {detail}"))
                return
            now = time.monotonic()
            broken_since = broken_since or now
            delay = self.client.retry.delay(attempt)
            if now - broken_since + delay > self.client.retry.deadline:
                self._fail(BufferUnavailableError(f"buffer at {self.client.address}: PutStream: {code.name} for {now - broken_since:.1f}s"))
                return
            log.debug("PutStream broken (%s); reopening in %.2fs at most", code.name, delay)
            self.client.pause(delay, code)  # on the same channel, as soon as it has reconnected
            attempt += 1

    def _resend_unacked(self) -> None:
        """The stream is gone: everything it did not acknowledge goes first on the next one."""
        with self._cond:
            self._generation += 1
            for batch in reversed(self._unacked.values()):
                self._waiting.extendleft(reversed(batch.items))
            self._unacked.clear()
            self._cond.notify_all()

    def _acknowledge(self, response: buffer_pb2.PutStreamResponse) -> None:
        done: list[tuple[_Item, BaseException | None]] = []
        with self._cond:
            for ack in response.acks:
                batch = self._unacked.pop(ack.sequence, None)
                if batch is None:
                    continue  # from a stream abandoned meanwhile
                if ack.code in RESEND:
                    # Full: everything after it waits too, so the order of an actor's Puts holds.
                    self._waiting.extendleft(reversed(batch.items))
                    hint = ack.retry_after_ms / 1000.0 or self.client.retry.initial
                    self._resume_at = max(self._resume_at, time.monotonic() + hint)
                    continue
                results = list(ack.results)
                if ack.code == INVALID_ARGUMENT and not results and len(batch.items) > 1:
                    # Refused as a whole (more than the buffer's capacity): our coalescing made it
                    # so, not the caller; send it again in smaller messages.
                    self._coalesce = max(1, len(batch.items) // 2)
                    self._waiting.extendleft(reversed(batch.items))
                    continue
                for index, item in enumerate(batch.items):
                    result = results[index] if index < len(results) else None
                    if ack.code == OK or (result is not None and result.code == OK):
                        done.append((item, None))
                    elif result is not None:
                        rejection = Rejection(index, item.episode_id, result.field, result.message)
                        done.append((item, InvalidTrajectoryError([rejection], 0)))
                    else:  # the batch as a whole (e.g. more than the buffer's capacity)
                        rejection = Rejection(index, item.episode_id, "trajectories", ack.message)
                        done.append((item, InvalidTrajectoryError([rejection], 0)))
            self._in_flight -= len(done)
            self._cond.notify_all()
        for item, error in done:  # outside the lock: callbacks may put more
            if error is None:
                item.future.set_result(None)
            else:
                item.future.set_exception(error)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._failed = error
            items = list(self._waiting) + [item for batch in self._unacked.values() for item in batch.items]
            self._waiting.clear()
            self._unacked.clear()
            self._in_flight = 0
            self._generation += 1
            self._cond.notify_all()
        for item in items:
            item.future.set_exception(error)
