"""Client library for the trajectory buffer, used by actors and the learner.

Actors::

    with BufferClient("buffer:50051", token=token, client_id="actor-3") as buffer:
        credit = buffer.acquire(2, wait=30)        # admission: may I start 2 groups?
        ...run episodes...
        buffer.put(episodes)                       # batched, retried, idempotent (by episode_id)

The learner::

    buffer = BufferClient(address, token=token, learner_id="learner")
    batch = buffer.sample(max_groups=4, min_groups=4, timeout=30)   # None if nothing in time
    if batch: train(batch.groups); buffer.commit(batch.batch_id)   # or commit_async(...)
    buffer.set_policy_version(step, duty_cycle=0.93)

Errors are exceptions by cause: ``InvalidTrajectoryError`` (a trajectory was refused; its field is
named; the valid ones were stored), ``AuthError``, ``LeaseLostError`` (commit of a batch the buffer
no longer leases: it will be delivered again), ``BufferUnavailableError`` (retries exhausted).
Transient failures (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``RESOURCE_EXHAUSTED`` = buffer full)
are retried with exponential backoff and full jitter until ``RetryPolicy.deadline``; Put is safe to
retry because the buffer stores each episode id once. The retry loop lives in ``client_retry``,
what the calls return and raise in ``client_types``; both are re-exported here.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stoker.buffer.admission import INCARNATION_KEY
from stoker.buffer.client_types import (
    AuthError,
    BufferClientError,
    BufferUnavailableError,
    Credit,
    Encodable,
    InvalidTrajectoryError,
    LeaseLostError,
    PutSummary,
    Rejection,
    RetryPolicy,
    SampledBatch,
    SampledGroup,
    decode_sample,
    encode_item,
    encode_sample,
    episode_id_of,
)
from stoker.buffer.client_retry import RETRYABLE, call_with_retries, pause, put_response_from_error
from stoker.buffer.put_stream import PutStream
from stoker.buffer.wire import encode_put_request
from stoker.channels import channel_options
from stoker.v1 import buffer_pb2

SERVICE = "/stoker.v1.Buffer/"


class BufferClient:
    """Synchronous, thread-safe client of one buffer (safe to share between an actor's threads)."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        client_id: str = "",
        learner_id: str = "learner",
        tls_ca: str | Path | None = None,
        retry: RetryPolicy = RetryPolicy(),
        timeout: float = 30.0,
        max_batch_trajectories: int = 64,
        max_batch_bytes: int = 32 << 20,
        max_message_bytes: int = 256 << 20,
    ):
        self.address = address
        self.client_id = client_id
        self.learner_id = learner_id
        self.session_id = uuid.uuid4().hex  # a new client is a new learner session (see SampleRequest)
        self.retry = retry
        self.timeout = timeout
        self.max_batch_trajectories = max_batch_trajectories
        self.max_batch_bytes = max_batch_bytes
        # Every call names this process (its session id): the buffer ties an actor's credit to it.
        auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._metadata: tuple[tuple[str, str], ...] = ((INCARNATION_KEY, self.session_id), *auth)
        # Bounded reconnect backoff (stoker.channels): back within about a second of the buffer.
        options = channel_options(
            [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]
        )
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)

        def method(name: str, response: Any, request_serializer: Callable[[Any], bytes] | None = None) -> Any:
            return self.channel.unary_unary(
                SERVICE + name,
                request_serializer=request_serializer or (lambda m: m.SerializeToString()),
                response_deserializer=response.FromString,
            )

        self._put = method("Put", buffer_pb2.PutResponse, request_serializer=bytes)
        self._acquire = method("Acquire", buffer_pb2.AcquireResponse)
        self._release = method("Release", buffer_pb2.ReleaseResponse)
        self._sample = method("Sample", buffer_pb2.SampleResponse)
        self._commit = method("Commit", buffer_pb2.CommitResponse)
        self._set_version = method("SetPolicyVersion", buffer_pb2.SetPolicyVersionResponse)
        self._stats = method("Stats", buffer_pb2.BufferStats)
        self._configure = method("Configure", buffer_pb2.ConfigureResponse)
        self._report_eval = method("ReportEval", buffer_pb2.ReportEvalResponse)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._committer: futures.ThreadPoolExecutor | None = None
        self._committer_lock = threading.Lock()

    def pause(self, delay: float, code: grpc.StatusCode | None = None) -> None:
        """Wait ``delay`` seconds before a retry, less after ``UNAVAILABLE`` once the channel has
        connected again (``client_retry.pause``)."""
        pause(self.channel, delay, code)

    # ------------------------------------------------------------------ plumbing

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        """One RPC with retries on transient errors; auth errors raised as AuthError."""
        return call_with_retries(
            method, request, timeout=timeout or self.timeout, metadata=self._metadata, retry=self.retry,
            address=self.address, pause=self.pause,
        )

    # ------------------------------------------------------------------ actors

    def put(self, items: Iterable[Encodable]) -> PutSummary:
        """Store trajectories durably (Episodes, wire Trajectories, or their serialized bytes).

        Sent in batches of at most ``max_batch_trajectories`` / ``max_batch_bytes``; each batch is
        retried until stored. Raises ``InvalidTrajectoryError`` after all batches are sent if any
        trajectory was refused (the others are stored).
        """
        items = list(items)
        encoded = [encode_item(item) for item in items]
        stored = duplicates = 0
        rejections: list[Rejection] = []
        start = 0
        while start < len(encoded):
            end, size = start, 0
            while end < len(encoded) and end - start < self.max_batch_trajectories:
                if end > start and size + len(encoded[end]) > self.max_batch_bytes:
                    break
                size += len(encoded[end])
                end += 1
            summary, bad = self.put_encoded(encoded[start:end])
            stored += summary.stored
            duplicates += summary.duplicates
            rejections += [
                Rejection(start + r.index, episode_id_of(items[start + r.index]), r.field, r.message) for r in bad
            ]
            start = end
        if rejections:
            raise InvalidTrajectoryError(rejections, stored)
        return PutSummary(stored, duplicates)

    def put_encoded(self, trajectories: Sequence[bytes]) -> tuple[PutSummary, list[Rejection]]:
        """Put one batch of serialized trajectories as a single RPC (with retries); return the
        summary and the refused ones (their ``index`` is within this batch). Low level: ``put``
        is the usual entry point."""
        request = encode_put_request(self.client_id, trajectories)
        try:
            response = self._call(self._put, request)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            response = put_response_from_error(exc)
            if response is None:  # the request as a whole was refused (malformed, or larger than the capacity)
                raise InvalidTrajectoryError([Rejection(-1, "", "trajectories", exc.details() or "")], 0) from None
        rejections = [
            Rejection(index, "", result.field, result.message)
            for index, result in enumerate(response.results)
            if result.code != 0
        ]
        return PutSummary(response.stored, response.duplicates), rejections

    def put_stream(self, *, window: int = 64) -> PutStream:
        """A ``PutStream``: ``put`` one trajectory at a time without waiting for it; each returns a
        future that completes once the buffer has it durably. Close it (or use ``with``) to wait
        for the last acknowledgements."""
        return PutStream(self, window=window, max_batch_trajectories=self.max_batch_trajectories, max_batch_bytes=self.max_batch_bytes)

    def acquire(
        self, groups: int, *, actor_id: str = "", wait: float = 0.0, load: buffer_pb2.ActorLoad | None = None
    ) -> Credit:
        """Ask for credit to start ``groups`` episode groups (admission control). With ``wait`` > 0,
        the buffer holds the call until something is granted or ``wait`` passes (a long poll; a
        buffer from before long polls answers at once, and is asked again at its suggested pace).
        ``load``: the actor's own figures, which the buffer shows in Stats (``actor_loads``)."""
        deadline = time.monotonic() + wait
        while True:
            left = max(0.0, deadline - time.monotonic())
            request = buffer_pb2.AcquireRequest(
                actor_id=actor_id or self.client_id, groups=groups, load=load, timeout_seconds=left
            )
            response = self._call(self._acquire, request, timeout=left + self.timeout)
            credit = Credit(response.granted, response.policy_version, response.retry_after_seconds)
            pause = max(credit.retry_after_seconds, 0.01)
            if credit.granted or time.monotonic() + pause > deadline:
                return credit
            time.sleep(pause)

    def release(self, groups: int, *, actor_id: str = "") -> None:
        """Give back credit for groups that will not be submitted after all."""
        self._call(self._release, buffer_pb2.ReleaseRequest(actor_id=actor_id or self.client_id, groups=groups))

    def report_eval(
        self, report_id: str, policy_version: int, *, episodes: int, reward_sum: float, success_sum: float, failed: int = 0
    ) -> None:
        """An evaluation round's sums (its episodes are never Put); retried safely: the buffer
        counts a ``report_id`` once."""
        request = buffer_pb2.ReportEvalRequest(
            report_id=report_id, policy_version=policy_version, episodes=episodes,
            reward_sum=reward_sum, success_sum=success_sum, failed_episodes=failed,
        )
        self._call(self._report_eval, request)

    # ------------------------------------------------------------------ learner

    def sample(self, max_groups: int, min_groups: int = 1, timeout: float = 10.0) -> SampledBatch | None:
        """Lease up to ``max_groups`` complete groups (in the buffer's ``sampleOrder``), waiting up to
        ``timeout`` seconds for ``min_groups``; None if they did not arrive. Commit the batch after
        training on it."""
        request = buffer_pb2.SampleRequest(
            learner_id=self.learner_id,
            session_id=self.session_id,
            max_groups=max_groups,
            min_groups=min_groups,
            timeout_seconds=timeout,
        )
        return decode_sample(self._call(self._sample, request, timeout=timeout + self.timeout))

    def commit(self, batch_id: str) -> int:
        """Mark a sampled batch as trained on; returns its trajectory count. ``LeaseLostError``
        if the buffer no longer leases it (it will deliver those groups again)."""
        try:
            return int(self._call(self._commit, buffer_pb2.CommitRequest(batch_id=batch_id)).committed_trajectories)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise LeaseLostError(exc.details()) from None
            raise

    def commit_async(self, batch_id: str) -> futures.Future[int]:
        """``commit`` in the background (one at a time, in order), so the learner can fetch the
        next batch while the log flush happens; the future raises what ``commit`` would."""
        with self._committer_lock:
            if self._committer is None:
                self._committer = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="buffer-commit")
            return self._committer.submit(self.commit, batch_id)

    def set_policy_version(self, version: int, duty_cycle: float | None = None) -> None:
        """Report the published policy version and, when known, the learner's duty cycle (the
        fraction of wall time it spent training, 0..1) for the operator's starvation check."""
        request = buffer_pb2.SetPolicyVersionRequest(policy_version=version)
        if duty_cycle is not None:
            request.learner_duty_cycle = duty_cycle
        self._call(self._set_version, request)

    # ------------------------------------------------------------------ everyone

    def stats(self) -> buffer_pb2.BufferStats:
        return self._call(self._stats, buffer_pb2.StatsRequest())

    def configure(self, *, capacity: int | None = None, max_staleness: int | None = None) -> None:
        """Change the settings the buffer applies live (the operator's call); None leaves one as it is."""
        request = buffer_pb2.ConfigureRequest()
        if capacity is not None:
            request.capacity = capacity
        if max_staleness is not None:
            request.max_staleness = max_staleness
        self._call(self._configure, request)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the buffer's health service reports SERVING; ``BufferUnavailableError`` if not in time."""
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                response = self._health.Check(
                    health_pb2.HealthCheckRequest(service="stoker.v1.Buffer"), timeout=max(0.1, remaining), wait_for_ready=True
                )
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE and exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            if time.monotonic() >= deadline:
                raise BufferUnavailableError(f"buffer at {self.address} not serving after {timeout:g}s")
            time.sleep(min(self.retry.delay(attempt), max(0.0, deadline - time.monotonic())))
            attempt += 1

    def close(self) -> None:
        """Finish background commits, then close the channel."""
        with self._committer_lock:
            if self._committer is not None:
                self._committer.shutdown(wait=True)
                self._committer = None
        self.channel.close()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "AuthError",
    "BufferClient",
    "BufferClientError",
    "BufferUnavailableError",
    "Credit",
    "InvalidTrajectoryError",
    "LeaseLostError",
    "PutSummary",
    "RETRYABLE",
    "Rejection",
    "RetryPolicy",
    "SampledBatch",
    "SampledGroup",
    "decode_sample",
    "encode_sample",
]
