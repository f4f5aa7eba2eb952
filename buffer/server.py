"""The buffer's gRPC service: ``stoker.v1.Buffer`` over ``BufferCore``, plus health, metrics, auth.

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

import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Histogram

from stoker.buffer.core import (
    BatchTooLarge,
    BufferCore,
    BufferFull,
    Unavailable,
    UnknownBatch,
)
from stoker.buffer.metrics import build_registry
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import WireError, encode_sample_response, split_put_request
from stoker.v1 import buffer_pb2

log = logging.getLogger("stoker.buffer.server")

SERVICE = "stoker.v1.Buffer"
PUT_RESPONSE_KEY = "stoker-put-response-bin"
RETRY_AFTER_KEY = "stoker-retry-after-ms"
TICK_SECONDS = 1.0
# Threads serving RPCs. Each one running Python contends for the GIL, and every handoff is a context
# switch: on a 2-core machine 4 threads moved 17 % more trajectories than 16 for ~15 % less server
# CPU each (benchmarks/README.md, buffer section). Calls beyond that wait in gRPC's queue. A
# learner's long-polling Sample holds a thread while it waits, so leave room for one per learner
# plus at least two (tests/buffer/test_server.py).
RPC_THREADS = 4


def _identity(data: bytes) -> bytes:
    return data


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


class BufferService:
    """RPC handlers; each maps ``BufferCore`` exceptions to status codes."""

    def __init__(self, core: BufferCore, put_latency: Histogram | None = None):
        self.core = core
        self.put_latency = put_latency
        self._all_stored: dict[int, bytes] = {}  # serialized PutResponse by batch size

    def put(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        started = time.perf_counter()
        try:
            client_id, raws = split_put_request(data)
        except WireError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed PutRequest ({exc})")
        try:
            outcome = self.core.put(raws, client_id)
        except BufferFull as exc:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(int(exc.retry_after * 1000))),))
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except BatchTooLarge as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Unavailable as exc:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
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
            context.set_trailing_metadata(((PUT_RESPONSE_KEY, response.SerializeToString()),))
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"trajectories[{index}]: {name}: {message}{more}; {outcome.stored} stored",
            )
        return response.SerializeToString()

    def acquire(self, request: buffer_pb2.AcquireRequest, context: grpc.ServicerContext) -> buffer_pb2.AcquireResponse:
        granted, version, retry = self.core.acquire(request.groups, request.actor_id)
        return buffer_pb2.AcquireResponse(granted=granted, policy_version=version, retry_after_seconds=retry)

    def release(self, request: buffer_pb2.ReleaseRequest, context: grpc.ServicerContext) -> buffer_pb2.ReleaseResponse:
        self.core.release(request.groups, request.actor_id)
        return buffer_pb2.ReleaseResponse()

    def sample(self, request: buffer_pb2.SampleRequest, context: grpc.ServicerContext) -> bytes:
        if request.max_groups < 1:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "max_groups: got 0; expected >= 1")
        if not 0 <= request.timeout_seconds <= 3600:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"timeout_seconds: got {request.timeout_seconds}; expected 0..3600")
        remaining = context.time_remaining()
        timeout = request.timeout_seconds if remaining is None else min(request.timeout_seconds, max(0.0, remaining - 0.05))
        batch = self.core.sample(
            request.max_groups,
            request.min_groups,
            timeout,
            learner_id=request.learner_id,
            session_id=request.session_id,
        )
        if batch is None:
            return encode_sample_response("", [], self.core.policy_version)
        return encode_sample_response(batch.batch_id, batch.groups, batch.policy_version)

    def commit(self, request: buffer_pb2.CommitRequest, context: grpc.ServicerContext) -> buffer_pb2.CommitResponse:
        try:
            count = self.core.commit(request.batch_id)
        except UnknownBatch:
            _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"batch_id: {request.batch_id!r} is not leased (already committed, lease expired, or the buffer "
                "restarted); its groups, if uncommitted, are delivered again",
            )
        except Unavailable as exc:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        return buffer_pb2.CommitResponse(committed_trajectories=count)

    def set_policy_version(
        self, request: buffer_pb2.SetPolicyVersionRequest, context: grpc.ServicerContext
    ) -> buffer_pb2.SetPolicyVersionResponse:
        duty = request.learner_duty_cycle if request.HasField("learner_duty_cycle") else None
        try:
            self.core.set_policy_version(request.policy_version, duty)
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return buffer_pb2.SetPolicyVersionResponse()

    def stats(self, request: buffer_pb2.StatsRequest, context: grpc.ServicerContext) -> buffer_pb2.BufferStats:
        return self.core.stats()

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[..., Any], request_type: Any, response_type: Any) -> grpc.RpcMethodHandler:
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


class BearerAuth(grpc.ServerInterceptor):
    """``UNAUTHENTICATED`` for any call without ``authorization: Bearer <token>`` (health exempt)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny, request_deserializer=_identity)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        for key, value in details.invocation_metadata:
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return continuation(details)
                break
        return self._deny


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


class BufferServer:
    """A running buffer: gRPC server, health, metrics endpoint, housekeeping thread."""

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
        rpc_threads: int = RPC_THREADS,
    ):
        self.settings = settings
        self.core = BufferCore(settings, data_dir)
        self.core.open()
        registry, put_latency = build_registry(self.core.stats)
        self.registry = registry
        self.service = BufferService(self.core, put_latency)
        options = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=rpc_threads, thread_name_prefix="buffer-rpc"),
            handlers=[self.service.handler()],
            interceptors=[BearerAuth(token)] if token else [],
            options=options,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        address = f"{host}:{port}"
        if tls is None:
            self.port = self.grpc_server.add_insecure_port(address)
        else:
            self.port = self.grpc_server.add_secure_port(address, tls.credentials())
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        self.metrics_port: int | None = None
        self._metrics_http: Any = None
        if metrics_port is not None:
            from prometheus_client import start_http_server

            self._metrics_http, _ = start_http_server(metrics_port, addr=metrics_host, registry=registry)
            self.metrics_port = int(self._metrics_http.server_port)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="buffer-tick", daemon=True)

    def start(self) -> BufferServer:
        self.grpc_server.start()
        self._ticker.start()
        for service in ("", SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("buffer serving on port %d", self.port, extra={"port": self.port, "metrics_port": self.metrics_port})
        return self

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
        self.health.enter_graceful_shutdown()
        self._stop.set()
        self.grpc_server.stop(grace).wait()
        self.core.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()


def write_ready_file(path: str | Path, port: int) -> None:
    """Write the bound port atomically: readers never see a half-written file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, target)
