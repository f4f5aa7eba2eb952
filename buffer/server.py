"""The buffer's gRPC service: ``stoker.v1.Buffer`` over ``BufferCore``, plus health, metrics, auth.

The server runs on one asyncio event loop in its own thread (``grpc.aio``). A Put validates, admits
and appends on the loop, then awaits its flush (``stoker.buffer.flusher``): no thread is held while
the disk works, and no pool of RPC threads contends for the GIL. A Put large enough to be written
with ``O_DIRECT`` (``stoker.buffer.wal``) does its part before the flush in a worker thread instead,
so the loop does not wait for the device. A long-polling Sample waits on the loop too, so any number
of learners can wait without starving the actors.

Put takes the request as raw bytes (``stoker.buffer.wire``) so trajectories reach the log exactly
as sent, and Sample answers with bytes assembled from stored trajectories: the service never
re-encodes a trajectory.

Put batch policy: every valid trajectory of a batch is stored, whatever its neighbours. If any
trajectory is invalid the RPC ends with ``INVALID_ARGUMENT`` naming the first bad one (index,
field, reason) and carries the full per-trajectory ``PutResponse`` in the trailing metadata key
``stoker-put-response-bin``; otherwise it returns that ``PutResponse``. A full buffer answers
``RESOURCE_EXHAUSTED`` (nothing stored) with the hint ``stoker-retry-after-ms`` in the trailing
metadata.

Auth: with a token, every call except the gRPC health service must carry
``authorization: Bearer <token>`` or gets ``UNAUTHENTICATED`` (health stays open so Kubernetes
gRPC probes, which cannot send headers, work).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Histogram

from stoker.buffer.core import (
    BatchTooLarge,
    BufferCore,
    BufferFull,
    DiskFull,
    PendingPut,
    PutOutcome,
    Unavailable,
    UnknownBatch,
)
from stoker.buffer.flusher import Flusher
from stoker.buffer.metrics import build_registry
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wal import DIRECT_MIN, WalError
from stoker.buffer.wire import WireError, encode_sample_response, split_put_request
from stoker.v1 import buffer_pb2

log = logging.getLogger("stoker.buffer.server")

SERVICE = "stoker.v1.Buffer"
PUT_RESPONSE_KEY = "stoker-put-response-bin"
RETRY_AFTER_KEY = "stoker-retry-after-ms"
TICK_SECONDS = 1.0
# Puts at least this big validate and append in a worker thread: their log write goes direct and
# waits for the device, which would stall every other call on the loop.
OFF_LOOP_PUT_BYTES = DIRECT_MIN
IO_THREADS = 4

T = TypeVar("T")
Metadata = Sequence[tuple[str, str | bytes]]


def _identity(data: bytes) -> bytes:
    return data


async def _abort(context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, message: str, trailing: Metadata = ()) -> NoReturn:
    await context.abort(code, message, trailing_metadata=trailing)
    raise AssertionError("unreachable: context.abort raises")


class BufferService:
    """RPC handlers (coroutines on the server's loop); each maps ``BufferCore`` exceptions to
    status codes. Construct it on the loop."""

    def __init__(self, core: BufferCore, flusher: Flusher, io_pool: futures.Executor, put_latency: Histogram | None = None):
        self.core = core
        self.flusher = flusher
        self.io_pool = io_pool
        self.put_latency = put_latency
        self.loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._all_stored: dict[int, bytes] = {}  # serialized PutResponse by batch size
        self._samplers: list[tuple[int, asyncio.Event]] = []  # waiting Samples: (min groups, wake-up)
        self._unfinished: set[asyncio.Future[Any]] = set()  # Puts whose callers left, and large Puts
        core.ready_listener = self._on_ready

    async def put(self, data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        started = time.perf_counter()
        try:
            client_id, raws = split_put_request(data)
        except WireError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed PutRequest ({exc})")
        try:
            if len(data) >= OFF_LOOP_PUT_BYTES:
                outcome = await self._put_off_loop(raws, client_id)
            else:
                outcome = await self._put_on_loop(raws, client_id)
        except (BufferFull, DiskFull) as exc:
            retry = ((RETRY_AFTER_KEY, str(int(exc.retry_after * 1000))),)
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), retry)
        except BatchTooLarge as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Unavailable as exc:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        if self.put_latency is not None:
            self.put_latency.observe(time.perf_counter() - started)
        if outcome.stored == len(outcome.results):  # the common case: every trajectory stored
            cached = self._all_stored.get(outcome.stored)
            if cached is None:
                cached = self._all_stored[outcome.stored] = buffer_pb2.PutResponse(
                    results=[buffer_pb2.PutResult()] * outcome.stored, stored=outcome.stored
                ).SerializeToString()
            return cached
        response = buffer_pb2.PutResponse(
            results=[buffer_pb2.PutResult(code=c, field=f, message=m) for c, f, m in outcome.results],
            stored=outcome.stored,
            duplicates=outcome.duplicates,
        )
        rejected = outcome.rejected
        if rejected:
            index, name, message = rejected[0]
            more = f" (and {len(rejected) - 1} more invalid)" if len(rejected) > 1 else ""
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"trajectories[{index}]: {name}: {message}{more}; {outcome.stored} stored",
                ((PUT_RESPONSE_KEY, response.SerializeToString()),),
            )
        return response.SerializeToString()

    # Once admitted, a Put is finished (stored, or taken back) even if its caller goes away meanwhile.

    async def _put_on_loop(self, raws: Sequence[memoryview], client_id: str) -> PutOutcome:
        return await self._finish_put(self.core.begin_put(raws, client_id))

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

    async def _put_off_loop(self, raws: Sequence[memoryview], client_id: str) -> PutOutcome:
        """A large Put validates and appends in a worker thread, as a task of its own that its
        caller's leaving does not cancel."""
        task = self.loop.create_task(self._put_in_worker(raws, client_id))
        self._unfinished.add(task)
        task.add_done_callback(self._put_in_worker_ended)
        return await asyncio.shield(task)

    async def _put_in_worker(self, raws: Sequence[memoryview], client_id: str) -> PutOutcome:
        pending = await self.loop.run_in_executor(self.io_pool, self.core.begin_put, raws, client_id)
        return await self._finish_put(pending)

    def _put_in_worker_ended(self, task: asyncio.Future[Any]) -> None:
        self._unfinished.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a Put whose caller left must not log "never retrieved"

    async def drain(self) -> None:
        """Wait for every admitted Put to finish (at shutdown, once no new calls come in)."""
        while self._unfinished:
            await asyncio.wait(list(self._unfinished))

    async def acquire(self, request: buffer_pb2.AcquireRequest, context: grpc.aio.ServicerContext[Any, Any]) -> buffer_pb2.AcquireResponse:
        granted, version, retry = self.core.acquire(request.groups, request.actor_id)
        return buffer_pb2.AcquireResponse(granted=granted, policy_version=version, retry_after_seconds=retry)

    async def release(self, request: buffer_pb2.ReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]) -> buffer_pb2.ReleaseResponse:
        self.core.release(request.groups, request.actor_id)
        return buffer_pb2.ReleaseResponse()

    async def sample(self, request: buffer_pb2.SampleRequest, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        if request.max_groups < 1:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "max_groups: got 0; expected >= 1")
        if not 0 <= request.timeout_seconds <= 3600:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"timeout_seconds: got {request.timeout_seconds}; expected 0..3600")
        remaining = context.time_remaining()
        timeout = request.timeout_seconds if remaining is None else min(request.timeout_seconds, max(0.0, remaining - 0.05))
        deadline = self.loop.time() + timeout
        # Registered before the first look, so a group made ready by another thread in between
        # still wakes this Sample.
        waiter = (max(1, min(request.min_groups, request.max_groups)), asyncio.Event())
        self._samplers.append(waiter)
        try:
            while True:
                waiter[1].clear()
                batch = self.core.sample(
                    request.max_groups, request.min_groups, 0.0, learner_id=request.learner_id, session_id=request.session_id
                )
                left = deadline - self.loop.time()
                if batch is not None or left <= 0:
                    break
                try:
                    await asyncio.wait_for(waiter[1].wait(), left)
                except TimeoutError:
                    pass
        finally:
            self._samplers.remove(waiter)
        if batch is None:
            return encode_sample_response("", [], self.core.policy_version)
        return encode_sample_response(batch.batch_id, batch.groups, batch.policy_version)

    def _on_ready(self, ready: int) -> None:
        """``BufferCore.ready_listener``: wake the Samples that can now return."""
        if not self._samplers:
            return
        if threading.get_ident() == self._loop_thread_id:
            self._wake_samplers(ready)
        else:
            self.loop.call_soon_threadsafe(self._wake_samplers, ready)

    def _wake_samplers(self, ready: int) -> None:
        for wanted, event in self._samplers:
            if ready >= wanted:
                event.set()

    async def commit(self, request: buffer_pb2.CommitRequest, context: grpc.aio.ServicerContext[Any, Any]) -> buffer_pb2.CommitResponse:
        try:
            count, position = self.core.begin_commit(request.batch_id)
        except UnknownBatch:
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"batch_id: {request.batch_id!r} is not leased (already committed, lease expired, or the buffer "
                "restarted); its groups, if uncommitted, are delivered again",
            )
        except Unavailable as exc:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            await self.flusher.durable(position)
        except WalError as exc:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        return buffer_pb2.CommitResponse(committed_trajectories=count)

    async def set_policy_version(
        self, request: buffer_pb2.SetPolicyVersionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> buffer_pb2.SetPolicyVersionResponse:
        duty = request.learner_duty_cycle if request.HasField("learner_duty_cycle") else None
        try:
            self.core.set_policy_version(request.policy_version, duty)
        except ValueError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return buffer_pb2.SetPolicyVersionResponse()

    async def stats(self, request: buffer_pb2.StatsRequest, context: grpc.aio.ServicerContext[Any, Any]) -> buffer_pb2.BufferStats:
        return self.core.stats()

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[..., Awaitable[Any]], request_type: Any, response_type: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn,
                request_deserializer=request_type.FromString if request_type else _identity,
                response_serializer=response_type.SerializeToString if response_type else _identity,
            )

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Put": unary(self.put, None, None),
                "Acquire": unary(self.acquire, buffer_pb2.AcquireRequest, buffer_pb2.AcquireResponse),
                "Release": unary(self.release, buffer_pb2.ReleaseRequest, buffer_pb2.ReleaseResponse),
                "Sample": unary(self.sample, buffer_pb2.SampleRequest, None),
                "Commit": unary(self.commit, buffer_pb2.CommitRequest, buffer_pb2.CommitResponse),
                "SetPolicyVersion": unary(
                    self.set_policy_version, buffer_pb2.SetPolicyVersionRequest, buffer_pb2.SetPolicyVersionResponse
                ),
                "Stats": unary(self.stats, buffer_pb2.StatsRequest, buffer_pb2.BufferStats),
            },
        )


class BearerAuth(grpc.aio.ServerInterceptor):
    """``UNAUTHENTICATED`` for any call without ``authorization: Bearer <token>`` (health exempt)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny, request_deserializer=_identity)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return await continuation(details)
                break
        return self._deny


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


class BufferServer:
    """A running buffer: gRPC server (on its own event-loop thread), health, metrics endpoint,
    housekeeping thread. The methods are plain blocking calls, for any thread."""

    def __init__(
        self,
        settings: BufferSettings,
        data_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        tls: TlsFiles | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ):
        self.settings = settings
        self.core = BufferCore(settings, data_dir)
        self.core.open()
        registry, put_latency = build_registry(self.core.stats)
        self.registry = registry
        self._io_pool = futures.ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="buffer-io")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="buffer-rpc", daemon=True)
        self._loop_thread.start()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="buffer-tick", daemon=True)
        self.metrics_port: int | None = None
        self._metrics_http: Any = None
        try:
            self.port = self._on_loop(self._bind(f"{host}:{port}", token, tls, put_latency))
            if metrics_port is not None:
                from prometheus_client import start_http_server

                self._metrics_http, _ = start_http_server(metrics_port, addr=metrics_host, registry=registry)
                self.metrics_port = int(self._metrics_http.server_port)
        except BaseException:
            self._close(grace=0)
            raise

    def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _bind(self, address: str, token: str | None, tls: TlsFiles | None, put_latency: Histogram) -> int:
        self._flusher = Flusher(self.core.wal, self._loop)
        self.service = BufferService(self.core, self._flusher, self._io_pool, put_latency)
        options = [
            ("grpc.max_receive_message_length", self.settings.max_message_bytes),
            ("grpc.max_send_message_length", self.settings.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.grpc_server = grpc.aio.server(
            handlers=[self.service.handler()],
            interceptors=[BearerAuth(token)] if token else [],
            options=options,
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        if tls is None:
            port = self.grpc_server.add_insecure_port(address)
        else:
            port = self.grpc_server.add_secure_port(address, tls.credentials())
        if port == 0:
            raise OSError(f"could not bind {address}")
        return port

    def start(self) -> BufferServer:
        self._on_loop(self._start())
        self._ticker.start()
        log.info("buffer serving on port %d", self.port, extra={"port": self.port, "metrics_port": self.metrics_port})
        return self

    async def _start(self) -> None:
        await self.grpc_server.start()
        for service in ("", SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            try:
                self.core.tick()
            except Exception:  # noqa: BLE001 - housekeeping must outlive one bad tick; logged
                log.exception("buffer housekeeping failed")

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving (in-flight calls get ``grace`` seconds) and close the log; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._close(grace)

    def _close(self, grace: float) -> None:
        if hasattr(self, "grpc_server"):
            self._on_loop(self._shut_down(grace))
        elif hasattr(self, "_flusher"):
            self._flusher.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.close()
        self._io_pool.shutdown()
        self.core.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()

    async def _shut_down(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        await self.service.drain()  # admitted Puts are stored (or taken back) before the log closes
        await asyncio.to_thread(self._flusher.stop)

    def wait(self) -> None:
        """Block until ``stop``."""
        self._stop.wait()


def write_ready_file(path: str | Path, port: int) -> None:
    """Write the bound port atomically: readers never see a half-written file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, target)
