"""``PutStream``: Puts on one bidirectional stream, acknowledged per durable flush.

A reader task takes each ``PutStreamRequest`` as it arrives, validates, admits and appends it
(``BufferService.submit``) and queues it with the future of the flush that makes it durable; it
never waits for the disk. The writer answers in order: once the oldest queued batch is durable it
acknowledges that one and every later one already durable (one flush settles them all at once)
in a single ``PutStreamResponse``. Refused batches are acknowledged in the same order with their
code, and the stream goes on. So a client sending one trajectory at a time pays one message per
trajectory and one acknowledgement per flush, not a round trip per trajectory.

A batch admitted before the stream breaks is still stored (or taken back) when its flush ends,
exactly as a unary Put whose caller left; the client resends what it did not see acknowledged
and the buffer's duplicate check (by episode id) keeps it stored once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from stoker.buffer.replies import Context, Refused, bounded, check_id, incarnation_of, invalid, put_response, rejection_summary
from stoker.buffer.service import BufferService
from stoker.buffer.state import PutOutcome
from stoker.buffer.wire import RETRY_AFTER_KEY, WireError, split_put_stream_request
from stoker.v1 import buffer_pb2

log = logging.getLogger("stoker.buffer.server")

# Batches a stream may have admitted and not yet acknowledged; reading pauses beyond it, so one
# stream's memory is bounded however fast its client sends.
STREAM_WINDOW = 256


@dataclass(eq=False)
class _Queued:
    sequence: int
    work: asyncio.Future[PutOutcome]  # the batch's outcome once durable, or its refusal


class PutStreamHandler:
    """The ``PutStream`` method of one ``BufferService``."""

    def __init__(self, service: BufferService):
        self.service = service

    def method(self) -> grpc.RpcMethodHandler:
        return grpc.stream_stream_rpc_method_handler(self.guarded, request_deserializer=None, response_serializer=None)

    async def guarded(self, requests: AsyncIterator[bytes], context: Context) -> None:
        """``handle``, with anything unexpected answered ``INTERNAL`` in one log line."""
        try:
            await self.handle(requests, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - one line, not a traceback per stream
            log.error("PutStream failed: %s: %s", type(exc).__name__, bounded(str(exc)))
            await context.abort(grpc.StatusCode.INTERNAL, f"PutStream: internal error ({type(exc).__name__})")

    async def handle(self, requests: AsyncIterator[bytes], context: Context) -> None:
        queue: collections.deque[_Queued] = collections.deque()
        progress = asyncio.Event()  # a batch queued, or the reading ended
        room = asyncio.Event()  # acknowledgements sent: the reader may go on
        reader = asyncio.get_running_loop().create_task(self._read(requests, context, queue, progress, room))
        try:
            while True:
                if not queue:
                    if reader.done():
                        error = reader.exception()
                        if isinstance(error, Refused):
                            self.service.refusals.warning("PutStream from %s: %s", context.peer(), error.message)
                            await context.abort(error.code, error.message)
                        if error is not None:
                            raise error
                        return  # the client closed its side and everything is acknowledged
                    progress.clear()
                    await progress.wait()
                    continue
                if not queue[0].work.done():
                    await asyncio.wait([queue[0].work])
                acks: list[buffer_pb2.PutAck] = []
                while queue and queue[0].work.done():
                    acks.append(self._ack(queue.popleft()))
                room.set()
                await context.write(buffer_pb2.PutStreamResponse(acks=acks).SerializeToString())
        finally:
            reader.cancel()

    async def _read(
        self,
        requests: AsyncIterator[bytes],
        context: Context,
        queue: collections.deque[_Queued],
        progress: asyncio.Event,
        room: asyncio.Event,
    ) -> None:
        service = self.service
        incarnation = incarnation_of(context)  # one actor process per stream
        try:
            async for data in requests:
                while len(queue) >= STREAM_WINDOW:
                    room.clear()
                    await room.wait()
                try:
                    sequence, client_id, raws = split_put_stream_request(data)
                except WireError as exc:
                    raise invalid(f"request: malformed PutStreamRequest ({exc})") from None
                check_id("client_id", client_id, service.core.settings.max_id_length)
                queue.append(_Queued(sequence, service.submit(raws, client_id, incarnation)))
                progress.set()
        finally:
            progress.set()

    def _ack(self, queued: _Queued) -> buffer_pb2.PutAck:
        """The acknowledgement of a batch whose outcome is known."""
        exc = queued.work.exception()
        if isinstance(exc, Refused):
            retry = next((int(v) for k, v in exc.trailing if k == RETRY_AFTER_KEY), 0)
            return buffer_pb2.PutAck(sequence=queued.sequence, code=exc.code.value[0], message=exc.message, retry_after_ms=retry)
        if exc is not None:
            log.error("PutStream batch failed: %s: %s", type(exc).__name__, bounded(str(exc)))
            return buffer_pb2.PutAck(sequence=queued.sequence, code=grpc.StatusCode.INTERNAL.value[0], message="internal error")
        outcome = queued.work.result()
        ack = buffer_pb2.PutAck(sequence=queued.sequence, stored=outcome.stored, duplicates=outcome.duplicates)
        if outcome.stored + outcome.duplicates != len(outcome.results):
            ack.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            ack.message = rejection_summary(outcome)
            ack.results.extend(put_response(outcome).results)
        return ack

