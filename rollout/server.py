"""The rollout server: ``stoker.v1.Rollout`` over the continuous-batching ``Engine``, plus gRPC
health (SERVING once weights are loaded), Prometheus gauges and the weight follower.

Weights follow the learner's channel exactly as actors do: the ``WeightSubscriber`` is polled
and each newer version is loaded between two segments; turns that start after it use it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Gauge

from stoker.endpoints import Address, add_grpc_port
from stoker.metrics_http import MetricsEndpoint, serve_metrics
from stoker.rollout.engine import Engine
from stoker.rollout.turns import EngineBusy, EngineStats, EngineStopped
from stoker.v1 import rollout_pb2, rollout_pb2_grpc
from stoker.weights.errors import WeightsError

log = logging.getLogger("stoker.rollout")

SERVICE = "stoker.v1.Rollout"
RETRY_AFTER_KEY = "retry-after-ms"
T = TypeVar("T")


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, engine: Engine, ready: threading.Event):
        self.engine = engine
        self.ready = ready

    async def Generate(self, request: rollout_pb2.GenerateRequest, context: Any) -> rollout_pb2.GenerateResponse:
        try:
            result = await self.engine.generate(
                list(request.prompt_ids),
                max_new_tokens=request.max_new_tokens,
                stop_token_ids=list(request.stop_token_ids),
                session=request.session,
                pin_weights=request.pin_weights,
                greedy=request.greedy,
            )
        except EngineBusy as exc:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), trailing_metadata=((RETRY_AFTER_KEY, str(exc.retry_after_ms)),)
            )
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return rollout_pb2.GenerateResponse(
            token_ids=result.token_ids, logprobs=result.logprobs, policy_versions=result.versions, finished=result.finished
        )

    async def EndSession(self, request: rollout_pb2.EndSessionRequest, context: Any) -> rollout_pb2.EndSessionResponse:
        self.engine.end_session(request.session)
        return rollout_pb2.EndSessionResponse()

    async def Stats(self, request: rollout_pb2.RolloutStatsRequest, context: Any) -> rollout_pb2.RolloutStats:
        return stats_message(self.engine.stats(), self.ready.is_set())


def stats_message(s: EngineStats, ready: bool) -> rollout_pb2.RolloutStats:
    return rollout_pb2.RolloutStats(
        policy_version=s.policy_version, live_versions=s.live_versions, tokens_per_second=s.tokens_per_second,
        queue_depth=s.queue_depth, running=s.running, max_batch=s.max_batch, batch_occupancy=s.batch_occupancy,
        kv_cache_bytes_used=s.kv_cache_bytes_used, kv_cache_bytes_total=s.kv_cache_bytes_total,
        requests_total=s.requests_total, rejected_total=s.rejected_total, ready=ready,
    )


def build_registry(engine: Engine) -> CollectorRegistry:
    """Gauges read from the engine at scrape time."""
    registry = CollectorRegistry()
    for name, doc, read in (
        ("tokens_per_second", "Sampled tokens per second over the last 10 s", lambda s: s.tokens_per_second),
        ("queue_depth", "Turns waiting for a batch slot", lambda s: s.queue_depth),
        ("running", "Turns in the decode batch", lambda s: s.running),
        ("batch_occupancy", "Mean running / max batch over the last 10 s", lambda s: s.batch_occupancy),
        ("kv_cache_bytes_used", "Conversation-cache bytes holding a session", lambda s: s.kv_cache_bytes_used),
        ("kv_cache_bytes_total", "Conversation-cache bytes", lambda s: s.kv_cache_bytes_total),
        ("policy_version", "Newest policy version loaded", lambda s: s.policy_version),
        ("live_versions", "Policy versions held (newest and pinned)", lambda s: len(s.live_versions)),
        ("requests_total", "Generate calls received", lambda s: s.requests_total),
        ("rejected_total", "Generate calls answered RESOURCE_EXHAUSTED", lambda s: s.rejected_total),
    ):
        gauge = Gauge(f"stoker_rollout_{name}", doc, registry=registry)
        gauge.set_function(lambda read=read: float(read(engine.stats())))  # type: ignore[misc]
    return registry


class RolloutServer:
    """A running rollout server: the engine thread, gRPC on its own event-loop thread, health,
    metrics and (with ``weights``) the weight follower. Methods are blocking, for any thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        weights: Any = None,  # a WeightSubscriber (latest_version/fetch), or None: serve what is loaded
        weight_poll_seconds: float = 1.0,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        address: Address | None = None,
        metrics_address: Address | None = None,
    ):
        """Serve on ``address`` (a unix socket or host:port; else ``host``:``port``), metrics on
        ``metrics_address`` (else ``metrics_host``:``metrics_port``; neither: none)."""
        address = address or Address(host=host, port=port)
        if metrics_address is None and metrics_port is not None:
            metrics_address = Address(host=metrics_host, port=metrics_port)
        self.engine = engine
        self.weights = weights
        self.weight_poll_seconds = weight_poll_seconds
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="rollout-rpc", daemon=True)
        self._loop_thread.start()
        self.address = self._on_loop(self._bind(address))  # where clients dial
        self.port = self.address.port  # 0 on a unix socket
        self._metrics: MetricsEndpoint | None = None
        if metrics_address is not None:
            self._metrics = serve_metrics(metrics_address, build_registry(engine), where="rollout metrics")
        self._follower = threading.Thread(target=self._follow_weights, name="rollout-weights", daemon=True)

    @property
    def metrics_port(self) -> int | None:
        return None if self._metrics is None else self._metrics.port

    def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _bind(self, address: Address) -> Address:
        self.grpc_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(self.engine, self.ready), self.grpc_server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        for service in ("", SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        bound = add_grpc_port(self.grpc_server, address, where="rollout server")
        await self.grpc_server.start()
        return bound

    def start(self) -> RolloutServer:
        """Load the newest published weights (if the channel has any), then serve."""
        self.engine.start()
        if self.weights is not None:
            self._poll_once()
            self._follower.start()
        self.ready.set()
        self._on_loop(self._serving())
        log.info("rollout server on %s serving policy version %d", self.address, self.engine.version)
        return self

    async def _serving(self) -> None:
        for service in ("", SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def _poll_once(self) -> None:
        try:
            latest = self.weights.latest_version()
            if latest > self.engine.version:
                flat = self.weights.fetch(latest)
                stage = getattr(flat, "stage", None)
                if callable(stage):  # sharded: read and check this host's slices here, not in the engine's swap
                    flat = stage(self.engine.sampler.weight_layout())
                self.engine.load_weights(flat, latest)
        except WeightsError as exc:
            log.warning("weight sync: %s; retrying", exc)

    def _follow_weights(self) -> None:
        while not self._stop.wait(self.weight_poll_seconds):
            self._poll_once()

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving: waiting turns fail UNAVAILABLE (callers retry elsewhere); idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.ready.clear()
        self._on_loop(self._shut_down(grace))
        self.engine.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.close()
        if self._metrics is not None:
            self._metrics.close()

    async def _shut_down(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        stopping = asyncio.ensure_future(self.grpc_server.stop(grace))
        await asyncio.to_thread(self.engine.stop)  # in-flight turns answer UNAVAILABLE, not hang
        await stopping

    def wait(self) -> None:
        """Until ``stop``, or until the engine ends on its own (``engine.failure`` says why)."""
        while not self._stop.is_set() and not self.engine.finished.wait(1.0):
            pass
