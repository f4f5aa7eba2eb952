"""Held-out evaluation reaches the RLJob status: a real buffer's Stats (over gRPC) -> the
operator's snapshot -> ``status.evaluation``, apart from the training figures."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from stoker.buffer.client import BufferClient
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.operator.control import StalenessWindow
from stoker.operator.jobstatus import Observed, build_status
from stoker.operator.observe import DeploymentObservation, LearnerObservation, snapshot_from_proto
from stoker.spec import RLJobSpec
from stoker.status import RLJobStatus

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def observed(stats: object) -> Observed:
    return Observed(
        spec=RLJobSpec(),
        generation=1,
        learner=LearnerObservation(exists=True, ready=True, message="1/1 slices ready"),
        actors=DeploymentObservation(exists=True, ready=2, replicas=2),
        actor_target=2,
        buffer=DeploymentObservation(exists=True, ready=1, replicas=1),
        stats=stats,  # type: ignore[arg-type]
        stats_error=None if stats is not None else "Stats: UNAVAILABLE",
        window=StalenessWindow(p50=0, max=0, dropped=0, groups=0),
        exceeded=False,
        starved=False,
        zombies_reaped=0,
        admission_scale=1.0,
    )


def test_the_newest_round_from_a_real_buffer_is_the_status_evaluation(tmp_path: Path) -> None:
    server = BufferServer(BufferSettings(group_size=2, sync="none"), tmp_path / "wal", host="127.0.0.1", port=0).start()
    try:
        with BufferClient(f"127.0.0.1:{server.port}", client_id="op") as client:
            client.wait_ready(10)
            before = build_status(observed(snapshot_from_proto(client.stats())), {}, T0)
            assert "evaluation" not in before  # no round yet: nothing invented
            client.report_eval("a/0", 0, episodes=4, reward_sum=0.4, success_sum=1.0)
            client.report_eval("a/10", 10, episodes=4, reward_sum=2.0, success_sum=3.0)
            client.report_eval("b/10", 10, episodes=4, reward_sum=2.0, success_sum=2.0)
            status = build_status(observed(snapshot_from_proto(client.stats())), {}, T0)
    finally:
        server.stop(grace=0.1)
    RLJobStatus.model_validate(status)  # the CRD's status schema accepts it
    assert status["evaluation"] == {"policyVersion": 10, "successRate": 0.625, "meanReward": 0.5, "episodes": 8}
    assert status["policyVersion"] == 0  # the training figures are the learner's, untouched
    # With the buffer unreachable the last known evaluation stays.
    kept = build_status(observed(None), status, T0)
    assert kept["evaluation"] == status["evaluation"]
