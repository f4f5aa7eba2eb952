"""The ``stoker.v1.Buffer`` RPC handlers over ``BufferCore``, as coroutines on the server's loop.

A Put validates, admits and appends on the loop, then awaits its flush (``stoker.buffer.flusher``):
no thread is held while the disk works. A Put large enough to be written with ``O_DIRECT``
(``stoker.buffer.wal``) does its part before the flush in a worker thread instead, so the loop does
not wait for the device. A long-polling Sample waits on the loop too, so any number of learners
can wait without starving the actors.

Put takes the request as raw bytes (``stoker.buffer.wire``) so trajectories reach the log exactly
as sent, and Sample answers with bytes assembled from stored trajectories: the service never
re-encodes a trajectory.

Put batch policy: every valid trajectory of a batch is stored, whatever its neighbours. If any
trajectory is invalid the RPC ends with ``INVALID_ARGUMENT`` naming the first bad one (index,
field, reason) and carries the full per-trajectory ``PutResponse`` in the trailing metadata key
``stoker-put-response-bin``; otherwise it returns that ``PutResponse``. A full buffer (or a full
log volume) answers ``RESOURCE_EXHAUSTED`` (nothing stored) with the hint ``stoker-retry-after-ms``
in the trailing metadata.

Every method parses its own request bytes and checks every field, so a malformed or out-of-range
request is ``INVALID_ARGUMENT`` with one (rate-limited) log line, never ``UNKNOWN`` with a
traceback; an unexpected failure is ``INTERNAL``, also one line. Messages are bounded in size.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import Message
from prometheus_client import Histogram

from stoker.buffer.core import BufferCore
from stoker.buffer.evaluation import EvalBook, InvalidReport
from stoker.buffer.flusher import Flusher
from stoker.buffer.replies import (
    Context,
    LogLimiter,
    Refused,
    abort,
    bounded,
    check_id,
    incarnation_of,
    invalid,
    parse_request,
    put_response,
    refusal,
    rejection_summary,
    trailing_put_response,
)
from stoker.buffer.state import BatchTooLarge, BufferFull, DiskFull, PendingPut, PutOutcome, Unavailable, UnknownBatch
from stoker.buffer.wakeups import Wakeups, wait_for_wake
from stoker.buffer.wal_direct import DIRECT_MIN
from stoker.buffer.wal_files import WalError
from stoker.buffer.wire import PUT_RESPONSE_KEY, WireError, encode_sample_response, split_put_request
from stoker.v1 import buffer_pb2

log = logging.getLogger("stoker.buffer.server")

SERVICE = "stoker.v1.Buffer"
# Puts at least this big validate and append in a worker thread: their log write goes direct and
# waits for the device, which would stall every other call on the loop.
OFF_LOOP_PUT_BYTES = DIRECT_MIN
MAX_SAMPLE_GROUPS = 1 << 16
MAX_CREDIT_GROUPS = 1 << 20
MAX_TIMEOUT_SECONDS = 3600.0
MAX_CAPACITY = 1 << 40  # trajectories; far past any disk
BATCH_ID_LENGTH = 32  # uuid4().hex


class BufferService:
    """RPC handlers (coroutines on the server's loop); each maps ``BufferCore`` exceptions to
    status codes. Construct it on the loop."""

    def __init__(self, core: BufferCore, flusher: Flusher, io_pool: futures.Executor, put_latency: Histogram | None = None):
        self.core = core
        self.flusher = flusher
        self.io_pool = io_pool
        self.put_latency = put_latency
        self.loop = asyncio.get_running_loop()
        self.refusals = LogLimiter()
        self._all_stored: dict[int, bytes] = {}  # serialized PutResponse by batch size
        self._samplers = Wakeups(self.loop)  # Samples waiting for groups, woken by the ready count
        self._acquirers = Wakeups(self.loop)  # Acquires waiting for credit
        self._unfinished: set[asyncio.Future[Any]] = set()  # Puts whose callers left, and large Puts
        self.evals = EvalBook()  # held-out evaluation rounds (ReportEval), shown in Stats
        core.ready_listener = self._samplers.wake
        core.credit_listener = self._acquirers.wake

    # ------------------------------------------------------------------ Put

    async def put(self, data: bytes, context: Context) -> bytes:
        started = time.perf_counter()
        client_id, raws = self.split_put(data)
        outcome = await self.store(raws, client_id, incarnation_of(context))
        if self.put_latency is not None:
            self.put_latency.observe(time.perf_counter() - started)
        if outcome.stored == len(outcome.results):  # the common case: every trajectory stored
            return self.all_stored(outcome.stored)
        response = put_response(outcome)
        rejected = outcome.rejected
        if rejected:
            raise invalid(rejection_summary(outcome), ((PUT_RESPONSE_KEY, trailing_put_response(response)),))
        return response.SerializeToString()

    def split_put(self, data: bytes | memoryview) -> tuple[str, list[memoryview]]:
        try:
            client_id, raws = split_put_request(bytes(data) if isinstance(data, memoryview) else data)
        except WireError as exc:
            raise invalid(f"request: malformed PutRequest ({exc})") from None
        check_id("client_id", client_id, self.core.settings.max_id_length)
        return client_id, raws

    def all_stored(self, count: int) -> bytes:
        cached = self._all_stored.get(count)
        if cached is None:
            cached = self._all_stored[count] = buffer_pb2.PutResponse(results=[buffer_pb2.PutResult()] * count, stored=count).SerializeToString()
        return cached

    async def store(self, raws: Sequence[memoryview], client_id: str, incarnation: str = "") -> PutOutcome:
        """Validate, admit, log and flush one batch; ``Refused`` for a full buffer or volume."""
        try:
            if sum(len(raw) for raw in raws) >= OFF_LOOP_PUT_BYTES:
                return await self._put_off_loop(raws, client_id, incarnation)
            return await self._finish_put(self.core.begin_put(raws, client_id, incarnation))
        except (BufferFull, DiskFull, BatchTooLarge, Unavailable) as exc:
            raise refusal(exc) from None

    def submit(self, raws: Sequence[memoryview], client_id: str, incarnation: str = "") -> asyncio.Future[PutOutcome]:
        """Start a Put without waiting for it (``PutStream``): the future gives its outcome once it
        is durable, or a ``Refused``. The Put runs to its end whether or not anyone still waits."""
        work: asyncio.Future[PutOutcome] = self.loop.create_future()
        work.add_done_callback(_retrieve)
        if sum(len(raw) for raw in raws) >= OFF_LOOP_PUT_BYTES:
            task = self.loop.create_task(self._begin_in_worker(raws, (client_id, incarnation), work))
            self._unfinished.add(task)
            task.add_done_callback(self._put_in_worker_ended)
            return work
        try:
            pending = self.core.begin_put(raws, client_id, incarnation)
        except Exception as exc:  # noqa: BLE001 - handed to whoever acknowledges the batch
            work.set_exception(refusal(exc))
            return work
        self._settle_when_durable(pending, work)
        return work

    async def _begin_in_worker(self, raws: Sequence[memoryview], sender: tuple[str, str], work: asyncio.Future[PutOutcome]) -> None:
        try:
            pending = await self.loop.run_in_executor(self.io_pool, self.core.begin_put, raws, *sender)
        except Exception as exc:  # noqa: BLE001 - handed to whoever acknowledges the batch
            work.set_exception(refusal(exc))
            return
        self._settle_when_durable(pending, work)

    def _settle_when_durable(self, pending: PendingPut, work: asyncio.Future[PutOutcome]) -> None:
        flushed = self.flusher.durable(pending.durable_at)
        self._unfinished.add(flushed)

        def settle(done: asyncio.Future[None]) -> None:
            self._unfinished.discard(done)
            if done.cancelled() or done.exception() is not None:
                self.core.abandon_put(pending)
                if not work.done():
                    work.set_exception(Refused(grpc.StatusCode.UNAVAILABLE, str(done.exception() or "the buffer is shutting down")))
            else:
                outcome = self.core.finish_put(pending)
                if not work.done():
                    work.set_result(outcome)

        flushed.add_done_callback(settle)

    # Once admitted, a Put is finished (stored, or taken back) even if its caller goes away meanwhile.

    async def _finish_put(self, pending: PendingPut) -> PutOutcome:
        try:
            await self.flusher.durable(pending.durable_at)
        except WalError as exc:
            self.core.abandon_put(pending)
            raise Unavailable(str(exc)) from exc
        except asyncio.CancelledError:  # the call was cancelled (the server is stopping)
            flushed = self.flusher.durable(pending.durable_at)
            self._unfinished.add(flushed)
            flushed.add_done_callback(functools.partial(self._finish_left_put, pending))
            raise
        return self.core.finish_put(pending)

    def _finish_left_put(self, pending: PendingPut, flushed: asyncio.Future[None]) -> None:
        self._unfinished.discard(flushed)
        if flushed.cancelled() or flushed.exception() is not None:
            self.core.abandon_put(pending)
        else:
            self.core.finish_put(pending)

    async def _put_off_loop(self, raws: Sequence[memoryview], client_id: str, incarnation: str) -> PutOutcome:
        """A large Put validates and appends in a worker thread, as a task of its own that its
        caller's leaving does not cancel."""
        task = self.loop.create_task(self._put_in_worker(raws, client_id, incarnation))
        self._unfinished.add(task)
        task.add_done_callback(self._put_in_worker_ended)
        return await asyncio.shield(task)

    async def _put_in_worker(self, raws: Sequence[memoryview], client_id: str, incarnation: str) -> PutOutcome:
        pending = await self.loop.run_in_executor(self.io_pool, self.core.begin_put, raws, client_id, incarnation)
        return await self._finish_put(pending)

    def _put_in_worker_ended(self, task: asyncio.Future[Any]) -> None:
        self._unfinished.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a Put whose caller left must not log "never retrieved"

    async def drain(self) -> None:
        """Wait for every admitted Put to finish (at shutdown, once no new calls come in)."""
        while self._unfinished:
            await asyncio.wait(list(self._unfinished))

    # ------------------------------------------------------------------ admission

    async def acquire(self, request: buffer_pb2.AcquireRequest, context: Context) -> buffer_pb2.AcquireResponse:
        check_id("actor_id", request.actor_id, self.core.settings.max_id_length)
        if request.groups > MAX_CREDIT_GROUPS:
            raise invalid(f"groups: got {request.groups}; expected at most {MAX_CREDIT_GROUPS}")
        if not 0 <= request.timeout_seconds <= MAX_TIMEOUT_SECONDS:  # NaN fails too
            raise invalid(f"timeout_seconds: got {request.timeout_seconds}; expected 0..{MAX_TIMEOUT_SECONDS:g}")
        load = request.load if request.HasField("load") else None
        incarnation = incarnation_of(context)
        deadline = self.loop.time() + self._wait_budget(request.timeout_seconds, context)
        # A long poll: an actor with no credit is answered the moment a new version (or a freed
        # group) makes room, not at its next retry. Registered before the first look, so credit
        # freed by another thread in between still wakes it.
        with self._acquirers.waiting() as wake:
            while True:
                wake.clear()
                granted, version, retry = self.core.acquire(request.groups, request.actor_id, load, incarnation)
                left = deadline - self.loop.time()
                if granted or left <= 0:
                    break
                await wait_for_wake(wake, left)
        return buffer_pb2.AcquireResponse(granted=granted, policy_version=version, retry_after_seconds=retry)

    @staticmethod
    def _wait_budget(timeout: float, context: Context) -> float:
        """How long a long poll may wait: its ``timeout_seconds``, answered before the caller's
        deadline."""
        remaining = context.time_remaining()
        return timeout if remaining is None else min(timeout, max(0.0, remaining - 0.05))

    async def release(self, request: buffer_pb2.ReleaseRequest, context: Context) -> buffer_pb2.ReleaseResponse:
        check_id("actor_id", request.actor_id, self.core.settings.max_id_length)
        if request.groups > MAX_CREDIT_GROUPS:
            raise invalid(f"groups: got {request.groups}; expected at most {MAX_CREDIT_GROUPS}")
        self.core.release(request.groups, request.actor_id, incarnation_of(context))
        return buffer_pb2.ReleaseResponse()

    # ------------------------------------------------------------------ Sample, Commit

    async def sample(self, request: buffer_pb2.SampleRequest, context: Context) -> bytes:
        check_id("learner_id", request.learner_id, self.core.settings.max_id_length)
        check_id("session_id", request.session_id, self.core.settings.max_id_length)
        if not 1 <= request.max_groups <= MAX_SAMPLE_GROUPS:
            raise invalid(f"max_groups: got {request.max_groups}; expected 1..{MAX_SAMPLE_GROUPS}")
        if request.min_groups > request.max_groups:
            raise invalid(f"min_groups: got {request.min_groups}; expected at most max_groups ({request.max_groups})")
        if not 0 <= request.timeout_seconds <= MAX_TIMEOUT_SECONDS:  # NaN fails too
            raise invalid(f"timeout_seconds: got {request.timeout_seconds}; expected 0..{MAX_TIMEOUT_SECONDS:g}")
        deadline = self.loop.time() + self._wait_budget(request.timeout_seconds, context)
        with self._samplers.waiting(max(1, min(request.min_groups, request.max_groups))) as wake:
            while True:
                wake.clear()
                batch = self.core.sample(
                    request.max_groups, request.min_groups, 0.0, learner_id=request.learner_id, session_id=request.session_id
                )
                left = deadline - self.loop.time()
                if batch is not None or left <= 0:
                    break
                await wait_for_wake(wake, left)
        if batch is None:
            return encode_sample_response("", [], self.core.policy_version)
        return encode_sample_response(batch.batch_id, batch.groups, batch.policy_version, batch.max_staleness)

    async def commit(self, request: buffer_pb2.CommitRequest, context: Context) -> buffer_pb2.CommitResponse:
        if not request.batch_id or len(request.batch_id) > 4 * BATCH_ID_LENGTH:
            raise invalid(f"batch_id: {len(request.batch_id)} characters; expected the batch_id a Sample returned")
        try:
            count, position = self.core.begin_commit(request.batch_id)
        except UnknownBatch:
            raise Refused(
                grpc.StatusCode.NOT_FOUND,
                f"batch_id: {bounded(request.batch_id, 2 * BATCH_ID_LENGTH)!r} is not leased (already committed, lease "
                "expired, or the buffer restarted); its groups, if uncommitted, are delivered again",
            ) from None
        except Unavailable as exc:
            raise Refused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        try:
            await self.flusher.durable(position)
        except WalError as exc:
            raise Refused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        return buffer_pb2.CommitResponse(committed_trajectories=count)

    # ------------------------------------------------------------------ learner, everyone

    async def set_policy_version(self, request: buffer_pb2.SetPolicyVersionRequest, context: Context) -> buffer_pb2.SetPolicyVersionResponse:
        duty = request.learner_duty_cycle if request.HasField("learner_duty_cycle") else None
        try:
            self.core.set_policy_version(request.policy_version, duty)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return buffer_pb2.SetPolicyVersionResponse()

    async def configure(self, request: buffer_pb2.ConfigureRequest, context: Context) -> buffer_pb2.ConfigureResponse:
        capacity = request.capacity if request.HasField("capacity") else None
        max_staleness = request.max_staleness if request.HasField("max_staleness") else None
        if capacity is not None and capacity > MAX_CAPACITY:
            raise invalid(f"capacity: got {capacity}; expected 1..{MAX_CAPACITY}")
        try:
            self.core.configure(capacity=capacity, max_staleness=max_staleness)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return buffer_pb2.ConfigureResponse()

    async def report_eval(self, request: buffer_pb2.ReportEvalRequest, context: Context) -> buffer_pb2.ReportEvalResponse:
        try:
            self.evals.report(request)
        except InvalidReport as exc:
            raise invalid(str(exc)) from None
        return buffer_pb2.ReportEvalResponse()

    async def stats(self, request: buffer_pb2.StatsRequest, context: Context) -> buffer_pb2.BufferStats:
        stats = self.core.stats()
        stats.eval_rounds.extend(self.evals.rounds())
        return stats

    def handler(self, extra: dict[str, grpc.RpcMethodHandler] | None = None) -> grpc.GenericRpcHandler:
        def unary(name: str, fn: Callable[..., Awaitable[Any]], request_type: type[Message] | None, response_type: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                self.guarded(name, fn, request_type),
                request_deserializer=None,  # raw bytes: a malformed request is INVALID_ARGUMENT, not UNKNOWN
                response_serializer=response_type.SerializeToString if response_type else None,
            )

        methods = {
            "Put": unary("Put", self.put, None, None),
            "Acquire": unary("Acquire", self.acquire, buffer_pb2.AcquireRequest, buffer_pb2.AcquireResponse),
            "Release": unary("Release", self.release, buffer_pb2.ReleaseRequest, buffer_pb2.ReleaseResponse),
            "Sample": unary("Sample", self.sample, buffer_pb2.SampleRequest, None),
            "Commit": unary("Commit", self.commit, buffer_pb2.CommitRequest, buffer_pb2.CommitResponse),
            "SetPolicyVersion": unary(
                "SetPolicyVersion", self.set_policy_version, buffer_pb2.SetPolicyVersionRequest, buffer_pb2.SetPolicyVersionResponse
            ),
            "Stats": unary("Stats", self.stats, buffer_pb2.StatsRequest, buffer_pb2.BufferStats),
            "Configure": unary("Configure", self.configure, buffer_pb2.ConfigureRequest, buffer_pb2.ConfigureResponse),
            "ReportEval": unary("ReportEval", self.report_eval, buffer_pb2.ReportEvalRequest, buffer_pb2.ReportEvalResponse),
            **(extra or {}),
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def guarded(
        self, name: str, fn: Callable[[Any, Context], Awaitable[Any]], request_type: type[Message] | None
    ) -> Callable[[bytes, Context], Awaitable[Any]]:
        """``fn`` with its request parsed from bytes, ``Refused`` turned into a status (one log
        line) and any other failure into ``INTERNAL`` (one log line, no traceback)."""

        async def handle(data: bytes, context: Context) -> Any:
            try:
                request = parse_request(request_type, data) if request_type is not None else data
                return await fn(request, context)
            except Refused as refused:
                self.refusals.warning("%s from %s: %s: %s", name, context.peer(), refused.code.name, refused.message)
                await abort(context, refused.code, refused.message, refused.trailing)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - one line, not a traceback per request
                log.error("%s failed: %s: %s", name, type(exc).__name__, bounded(str(exc)))
                await abort(context, grpc.StatusCode.INTERNAL, f"{name}: internal error ({type(exc).__name__})")

        return handle


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: a batch whose stream went away must not log it at exit."""
    if not future.cancelled():
        future.exception()
