"""How the buffer's RPCs answer when they do not simply return: ``Refused`` (a status code, a
bounded message, trailing metadata) and the request checks that raise it, the status each of
``BufferCore``'s exceptions is answered with, a rate limit on the log lines for refusals, and the
``PutResponse`` of a batch with invalid trajectories. Shared by the unary handlers
(``stoker.buffer.service``) and ``PutStream`` (``stoker.buffer.stream``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeAlias

import grpc
from google.protobuf.message import DecodeError, Message

from stoker.buffer.admission import INCARNATION_KEY
from stoker.buffer.state import BatchTooLarge, BufferFull, DiskFull, PutOutcome, Unavailable
from stoker.buffer.wire import RETRY_AFTER_KEY
from stoker.v1 import buffer_pb2

log = logging.getLogger("stoker.buffer.server")

MAX_DETAIL = 300  # characters of any status message; a client's bytes never make it longer
MAX_TRAILING_BYTES = 4096

Metadata = Sequence[tuple[str, str | bytes]]
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


def bounded(text: str, limit: int = MAX_DETAIL) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class Refused(Exception):
    """A request the service answers with ``code`` and ``message`` (logged once, no traceback)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: Metadata = ()):
        super().__init__(message)
        self.code = code
        self.message = bounded(message)
        self.trailing = trailing


def invalid(message: str, trailing: Metadata = ()) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, message, trailing)


class LogLimiter:
    """At most ``per_second`` log lines a second for refused requests; the rest are counted and
    reported with the next line let through, so a flood of bad requests cannot flood the log."""

    def __init__(self, per_second: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.per_second = per_second
        self.clock = clock
        self._allowance = per_second
        self._last = clock()
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> None:
        with self._lock:
            now = self.clock()
            self._allowance = min(self.per_second, self._allowance + (now - self._last) * self.per_second)
            self._last = now
            if self._allowance < 1.0:
                self._suppressed += 1
                return
            self._allowance -= 1.0
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            log.warning(message + " (and %d similar lines suppressed)", *args, suppressed)
        else:
            log.warning(message, *args)


async def abort(context: Context, code: grpc.StatusCode, message: str, trailing: Metadata = ()) -> NoReturn:
    await context.abort(code, message, trailing_metadata=trailing)
    raise AssertionError("unreachable: context.abort raises")


def check_id(name: str, value: str, limit: int = 256) -> None:
    if len(value) > limit:
        raise invalid(f"{name}: {len(value)} characters; expected at most {limit}")


def incarnation_of(context: Context) -> str:
    """The calling actor process's id (``INCARNATION_KEY`` metadata), "" when it sent none."""
    for key, value in context.invocation_metadata() or ():
        if key == INCARNATION_KEY:
            text = value if isinstance(value, str) else value.decode(errors="replace")
            check_id(INCARNATION_KEY, text, 64)  # a uuid; bounded because the buffer keeps one per process
            return text
    return ""


def parse_request(request_type: type[Message], data: bytes) -> Any:
    try:
        request = request_type.FromString(data)
    except DecodeError as exc:
        raise invalid(f"request: malformed {request_type.DESCRIPTOR.name} ({bounded(str(exc), 100)})") from None
    for field, value in request.ListFields():
        if isinstance(value, float) and not math.isfinite(value):
            raise invalid(f"{field.name}: got {value}; expected a finite number")
    return request


def refusal(exc: Exception) -> Exception:
    """A Put's failure as the status it is answered with (anything unexpected stays as it is)."""
    if isinstance(exc, (BufferFull, DiskFull)):
        retry = ((RETRY_AFTER_KEY, str(int(exc.retry_after * 1000))),)
        return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), retry)
    if isinstance(exc, BatchTooLarge):
        return invalid(str(exc))
    if isinstance(exc, Unavailable):
        return Refused(grpc.StatusCode.UNAVAILABLE, str(exc))
    return exc


def put_response(outcome: PutOutcome) -> buffer_pb2.PutResponse:
    return buffer_pb2.PutResponse(
        results=[buffer_pb2.PutResult(code=c, field=f, message=bounded(m, 200)) for c, f, m in outcome.results],
        stored=outcome.stored,
        duplicates=outcome.duplicates,
    )


def trailing_put_response(response: buffer_pb2.PutResponse) -> bytes:
    """The PutResponse for trailing metadata, which gRPC clients accept up to 8 KiB by default:
    past ``MAX_TRAILING_BYTES`` the per-trajectory messages go (codes and fields stay)."""
    encoded = response.SerializeToString()
    if len(encoded) <= MAX_TRAILING_BYTES:
        return encoded
    for result in response.results:
        result.message = ""
    return response.SerializeToString()


def rejection_summary(outcome: PutOutcome) -> str:
    rejected = outcome.rejected
    index, name, message = rejected[0]
    more = f" (and {len(rejected) - 1} more invalid)" if len(rejected) > 1 else ""
    return f"trajectories[{index}]: {name}: {bounded(message, 200)}{more}; {outcome.stored} stored"
