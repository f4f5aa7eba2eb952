"""The buffer's gRPC server: ``stoker.v1.Buffer`` (``stoker.buffer.service``) plus health, metrics,
auth and housekeeping, on one asyncio event loop in its own thread (``grpc.aio``).

Auth: with a token, every call except the gRPC health service must carry
``authorization: Bearer <token>`` or gets ``UNAUTHENTICATED`` (health stays open so Kubernetes
gRPC probes, which cannot send headers, work).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2
from prometheus_client import Histogram

from stoker.buffer.core import BufferCore
from stoker.buffer.flusher import Flusher
from stoker.buffer.metrics import build_registry
from stoker.buffer.service import SERVICE, BufferService
from stoker.buffer.settings import BufferSettings
from stoker.buffer.stream import PutStreamHandler
from stoker.endpoints import Address, add_grpc_port
from stoker.metrics_http import MetricsEndpoint, serve_metrics

__all__ = ["BearerAuth", "BufferServer", "TlsFiles"]

log = logging.getLogger("stoker.buffer.server")

TICK_SECONDS = 1.0
IO_THREADS = 4

T = TypeVar("T")


def _identity(data: bytes) -> bytes:
    return data


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
        address: Address | None = None,
        metrics_address: Address | None = None,
    ):
        """Serve on ``address`` (a unix socket or host:port; else ``host``:``port``), metrics on
        ``metrics_address`` (else ``metrics_host``:``metrics_port``; neither: none)."""
        address = address or Address(host=host, port=port)
        if metrics_address is None and metrics_port is not None:
            metrics_address = Address(host=metrics_host, port=metrics_port)
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
        self._metrics: MetricsEndpoint | None = None
        try:
            self.address = self._on_loop(self._bind(address, token, tls, put_latency))  # where clients dial
            self.port = self.address.port  # 0 on a unix socket
            if metrics_address is not None:
                self._metrics = serve_metrics(metrics_address, registry, where="buffer metrics")
        except BaseException:
            self._close(grace=0)
            raise

    @property
    def metrics_port(self) -> int | None:
        return None if self._metrics is None else self._metrics.port

    def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _bind(self, address: Address, token: str | None, tls: TlsFiles | None, put_latency: Histogram) -> Address:
        self._flusher = Flusher(self.core.wal, self._loop)
        self.service = BufferService(self.core, self._flusher, self._io_pool, put_latency)
        options = [
            ("grpc.max_receive_message_length", self.settings.max_message_bytes),
            ("grpc.max_send_message_length", self.settings.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.grpc_server = grpc.aio.server(
            handlers=[self.service.handler({"PutStream": PutStreamHandler(self.service).method()})],
            interceptors=[BearerAuth(token)] if token else [],
            options=options,
        )
        self.health = health.aio.HealthServicer()
        self.grpc_server.add_generic_rpc_handlers((self._health_handler(),))
        return add_grpc_port(self.grpc_server, address, where="buffer", credentials=None if tls is None else tls.credentials())

    def _health_handler(self) -> grpc.GenericRpcHandler:
        """grpc.health.v1.Health, its requests parsed as the Buffer's are: a malformed one is
        INVALID_ARGUMENT with one rate-limited log line, not UNKNOWN with a traceback."""
        request, response = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse.SerializeToString
        guarded = self.service.guarded
        methods = {
            "Check": grpc.unary_unary_rpc_method_handler(
                guarded("Health/Check", self.health.Check, request), response_serializer=response
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                guarded("Health/Watch", self.health.Watch, request), response_serializer=response
            ),
        }
        return grpc.method_handlers_generic_handler("grpc.health.v1.Health", methods)

    def start(self) -> BufferServer:
        self._on_loop(self._start())
        self._ticker.start()
        log.info("buffer serving on %s", self.address, extra={"address": str(self.address), "metrics_port": self.metrics_port})
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
        if self._metrics is not None:
            self._metrics.close()

    async def _shut_down(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        await self.service.drain()  # admitted Puts are stored (or taken back) before the log closes
        await asyncio.to_thread(self._flusher.stop)

    def wait(self) -> None:
        """Block until ``stop``."""
        self._stop.wait()
