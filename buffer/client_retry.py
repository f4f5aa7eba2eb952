"""The buffer client's retries: which gRPC failures are transient, how long to wait before the
next attempt (less once a lost channel has connected again), the buffer's retry-after hint and
the Put response it sends back with a refusal. ``BufferClient`` calls every RPC through
``call_with_retries``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from stoker.buffer.client_types import AuthError, BufferClientError, BufferUnavailableError, RetryPolicy
from stoker.buffer.wire import PUT_RESPONSE_KEY, RETRY_AFTER_KEY
from stoker.v1 import buffer_pb2

__all__ = ["CONNECTED_NOW_SECONDS", "RETRYABLE", "call_with_retries", "pause", "put_response_from_error", "retry_hint"]

# How long a channel being watched may take to report its current state.
CONNECTED_NOW_SECONDS = 0.05
# CANCELLED too: a buffer stopping cancels the calls it has in flight (gRPC's GOAWAY "Cancelling
# all calls"); this client cancels its own calls only by closing, after which a retry is refused.
RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
})


def pause(channel: grpc.Channel, delay: float, code: grpc.StatusCode | None = None) -> None:
    """Wait ``delay`` seconds before a retry; after ``UNAVAILABLE`` on a channel that is not
    connected, only until gRPC has connected it again, so the retry does not wait out the rest of
    its sleep. An ``UNAVAILABLE`` the buffer itself answered (the channel connected all along)
    waits the whole delay. The channel is watched only while pausing (gRPC polls a watched channel
    from a thread of its own)."""
    if code != grpc.StatusCode.UNAVAILABLE:
        time.sleep(delay)
        return
    started = time.monotonic()
    connected, reported = threading.Event(), threading.Event()

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state == grpc.ChannelConnectivity.READY:
            connected.set()
        else:
            connected.clear()
        reported.set()

    # Not try_to_connect: the failed call already set gRPC reconnecting, and a connect request
    # pending when the channel closes makes gRPC's polling thread fail on the closed channel.
    channel.subscribe(watch, try_to_connect=False)
    try:
        reported.wait(min(delay, CONNECTED_NOW_SECONDS))  # the first report is the current state
        if connected.is_set():
            time.sleep(max(0.0, delay - (time.monotonic() - started)))
        else:
            connected.wait(max(0.0, delay - (time.monotonic() - started)))
    finally:
        channel.unsubscribe(watch)


def call_with_retries(
    method: Any, request: Any, *, timeout: float, metadata: tuple[tuple[str, str], ...], retry: RetryPolicy,
    address: str, pause: Callable[[float, grpc.StatusCode | None], None],
) -> Any:
    """One RPC, retried on transient errors until ``retry.deadline`` (``pause`` waits between
    attempts); auth errors raised as ``AuthError``, exhausted retries as ``BufferUnavailableError``."""
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return method(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise AuthError(exc.details()) from None
            hint = retry_hint(exc)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and hint is None:
                # Not the buffer saying "full" (that always carries a hint) but gRPC refusing an
                # oversized message: retrying cannot help.
                raise BufferClientError(f"buffer at {address}: {exc.details()}") from None
            if code not in RETRYABLE:
                raise
            delay = retry.delay(attempt, hint or 0.0)
            if time.monotonic() - started + delay > retry.deadline:
                raise BufferUnavailableError(
                    f"buffer at {address}: {code.name}: {exc.details()} "
                    f"(gave up after {time.monotonic() - started:.1f}s)"
                ) from None
            pause(delay, None if hint else code)
            attempt += 1


def _trailing(exc: grpc.RpcError, key: str) -> Any:
    for k, value in exc.trailing_metadata() or ():
        if k == key:
            return value
    return None


def retry_hint(exc: grpc.RpcError) -> float | None:
    """The buffer's retry-after hint in seconds, None when absent."""
    value = _trailing(exc, RETRY_AFTER_KEY)
    if value is None:
        return None
    try:
        return float(value) / 1000.0
    except ValueError:
        return 0.0


def put_response_from_error(exc: grpc.RpcError) -> buffer_pb2.PutResponse | None:
    """The per-trajectory results the buffer sent with a refused Put, None when it sent none."""
    value = _trailing(exc, PUT_RESPONSE_KEY)
    return buffer_pb2.PutResponse.FromString(value) if value is not None else None
