"""Prometheus metrics of the operator: per-RLJob figures from its status, and its actions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

LABELS = ("namespace", "rljob")


class OperatorMetrics:
    """One registry per operator process (tests run several), served by ``--metrics-port``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.policy_version = Gauge("stoker_rljob_policy_version", "Learner policy version", LABELS, registry=r)
        self.buffer_fill = Gauge("stoker_rljob_buffer_fill", "Buffer fill (trajectories waiting for the learner / capacity)", LABELS, registry=r)
        self.staleness_max = Gauge("stoker_rljob_staleness_max", "Max staleness over the last window", LABELS, registry=r)
        self.duty_cycle = Gauge("stoker_rljob_learner_duty_cycle", "Learner duty cycle", LABELS, registry=r)
        self.actors_desired = Gauge("stoker_rljob_actors_desired", "Actor replica target", LABELS, registry=r)
        self.actors_ready = Gauge("stoker_rljob_actors_ready", "Ready actor pods", LABELS, registry=r)
        self.ready = Gauge("stoker_rljob_ready", "1 when the RLJob's Ready condition is True", LABELS, registry=r)
        self.zombies = Counter("stoker_rljob_zombies_reaped", "Zombie sandbox pods deleted", LABELS, registry=r)
        self.actions = Counter(
            "stoker_operator_actions", "Enforcement actions taken", (*LABELS, "reason"), registry=r
        )

    def observe(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        labels = (namespace, name)
        for gauge, value in (
            (self.policy_version, status.get("policyVersion")),
            (self.buffer_fill, status.get("bufferFill")),
            (self.staleness_max, (status.get("staleness") or {}).get("max")),
            (self.duty_cycle, status.get("learnerDutyCycle")),
            (self.actors_desired, (status.get("actors") or {}).get("desired")),
            (self.actors_ready, (status.get("actors") or {}).get("ready")),
        ):
            if value is not None:
                gauge.labels(*labels).set(float(value))
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
        if ready is not None:
            self.ready.labels(*labels).set(1.0 if ready.get("status") == "True" else 0.0)

    def action(self, namespace: str, name: str, reason: str) -> None:
        self.actions.labels(namespace, name, reason).inc()

    def reaped(self, namespace: str, name: str, count: int) -> None:
        self.zombies.labels(namespace, name).inc(count)

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted RLJob's series."""
        for metric in (self.policy_version, self.buffer_fill, self.staleness_max, self.duty_cycle,
                       self.actors_desired, self.actors_ready, self.ready, self.zombies):
            try:
                metric.remove(namespace, name)
            except KeyError:
                pass  # never observed
