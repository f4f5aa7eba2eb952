"""Prometheus metrics for the buffer: a collector that reads ``BufferStats`` at scrape time, so
the hot path pays only for the Put latency histogram."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stoker.v1 import buffer_pb2

PREFIX = "stoker_buffer"


class StatsCollector(Collector):
    def __init__(self, stats: Callable[[], buffer_pb2.BufferStats]):
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        gauges = {
            "capacity_trajectories": ("Trajectories waiting for the learner before Puts are refused.", s.capacity),
            "stored_trajectories": ("Accepted trajectories not yet committed (leased included).", s.stored_trajectories),
            "stored_bytes": ("Bytes of stored trajectories.", s.stored_bytes),
            "fill_ratio": ("trajectories waiting (stored, not leased) / capacity.", s.fill),
            "complete_groups": ("Groups ready to sample.", s.complete_groups),
            "incomplete_groups": ("Groups still waiting for episodes.", s.incomplete_groups),
            "overdue_incomplete_groups": ("Incomplete groups older than the group timeout.", s.stale_incomplete_groups),
            "leased_batches": ("Sampled batches not yet committed.", s.leased_batches),
            "policy_version": ("The learner's current policy version.", s.policy_version),
            "admission_credit_groups": ("Groups actors may still start (AReaL rule).", s.admission_credit),
            "in_flight_groups": ("Groups granted credit and not yet complete.", s.in_flight_groups),
            "put_rate": ("Trajectories accepted per second over the last minute.", s.put_rate),
            "sample_rate": ("Trajectories sampled per second over the last minute.", s.sample_rate),
            "log_bytes": ("Write-ahead log size on disk.", s.log_bytes),
            "log_segments": ("Write-ahead log segment files.", s.log_segments),
            "disk_full": ("1 while the log's volume is full and Puts are refused (Commits still go through).", s.disk_full),
            "disk_free_bytes": ("Free space on the log's volume.", s.disk_free_bytes),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        counters = {
            "accepted_trajectories": ("Trajectories accepted.", s.accepted_total),
            "sampled_trajectories": ("Trajectories delivered to the learner.", s.sampled_total),
            "committed_trajectories": ("Trajectories committed by the learner.", s.committed_total),
            "duplicate_trajectories": ("Retried trajectories recognised and not stored twice.", s.duplicates_total),
            "redelivered_groups": ("Leased groups returned to the queue.", s.redelivered_groups),
            "masked_groups_delivered": ("Groups with a failed episode delivered masked.", s.masked_groups_delivered),
            "full_rejections": ("Put batches refused because the buffer was full.", s.full_rejections),
            "disk_full_rejections": ("Put batches refused because the log's volume was full.", s.disk_full_rejections),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        dropped = CounterMetricFamily(f"{PREFIX}_dropped_groups", "Groups dropped, by reason.", labels=["reason"])
        for reason in ("stale", "failed"):
            dropped.add_metric([reason], float(s.dropped.get(reason, 0)))
        yield dropped
        rejected = CounterMetricFamily(f"{PREFIX}_rejected_trajectories", "Invalid trajectories, by field.", labels=["field"])
        for name, value in sorted(s.rejected.items()):
            rejected.add_metric([name], float(value))
        yield rejected
        staleness = CounterMetricFamily(
            f"{PREFIX}_staleness_groups", "Groups delivered, by policy versions behind at sample time.", labels=["versions_behind"]
        )
        for behind, value in sorted(s.staleness_histogram.items()):
            staleness.add_metric([str(behind)], float(value))
        yield staleness
        actors = CounterMetricFamily(f"{PREFIX}_actor_accepted_trajectories", "Trajectories accepted, by actor.", labels=["actor"])
        for actor, value in sorted(s.per_actor_accepted.items()):
            actors.add_metric([actor], float(value))
        yield actors


def build_registry(stats: Callable[[], buffer_pb2.BufferStats]) -> tuple[CollectorRegistry, Histogram]:
    """A registry of its own (several buffers may share a test process) and the Put latency histogram."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(stats))
    put_latency = Histogram(
        f"{PREFIX}_put_seconds",
        "Put latency in the server, validation and log flush included.",
        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
        registry=registry,
    )
    return registry, put_latency
