"""Operator metrics follow the status the operator writes, and go away with the RLJob."""

from __future__ import annotations

from prometheus_client import generate_latest

from stoker.operator.metrics import OperatorMetrics


def test_status_becomes_series_and_is_forgotten() -> None:
    metrics = OperatorMetrics()
    metrics.observe("ns", "lake", {"policyVersion": 12, "bufferFill": 0.5, "staleness": {"max": 3},
                                   "actors": {"desired": 4, "ready": 3},
                                   "conditions": [{"type": "Ready", "status": "True"}]})
    metrics.action("ns", "lake", "ScaledDownActors")
    metrics.reaped("ns", "lake", 2)
    text = generate_latest(metrics.registry).decode()
    for line in ('stoker_rljob_policy_version{namespace="ns",rljob="lake"} 12.0',
                 'stoker_rljob_staleness_max{namespace="ns",rljob="lake"} 3.0',
                 'stoker_rljob_ready{namespace="ns",rljob="lake"} 1.0',
                 'stoker_rljob_zombies_reaped_total{namespace="ns",rljob="lake"} 2.0',
                 'stoker_operator_actions_total{namespace="ns",reason="ScaledDownActors",rljob="lake"} 1.0'):
        assert line in text
    assert "stoker_rljob_learner_duty_cycle{" not in text  # unknown stays absent, not 0
    metrics.forget("ns", "lake")
    assert 'stoker_rljob_policy_version{namespace="ns"' not in generate_latest(metrics.registry).decode()
