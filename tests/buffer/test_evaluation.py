"""Held-out evaluation results over a real gRPC server: ReportEval folds actor rounds into one
aggregate per policy version, shown in Stats; retries count once; bad reports are refused."""

from __future__ import annotations

import grpc
import pytest

from stoker.buffer.client import BufferClient
from stoker.buffer.evaluation import EvalBook
from stoker.v1 import buffer_pb2


def test_rounds_aggregate_across_actors_and_retries_count_once(buffer: BufferClient) -> None:
    assert list(buffer.stats().eval_rounds) == []
    buffer.report_eval("actor-0/0", 0, episodes=4, reward_sum=1.0, success_sum=1.0)
    buffer.report_eval("actor-1/0", 0, episodes=4, reward_sum=2.0, success_sum=2.0, failed=1)
    buffer.report_eval("actor-1/0", 0, episodes=4, reward_sum=2.0, success_sum=2.0, failed=1)  # a retry
    buffer.report_eval("actor-0/10", 10, episodes=4, reward_sum=3.5, success_sum=3.0)
    rounds = list(buffer.stats().eval_rounds)
    assert [(r.policy_version, r.episodes, r.reports, r.failed_episodes) for r in rounds] == [(0, 8, 2, 1), (10, 4, 1, 0)]
    assert rounds[0].success_rate == pytest.approx(3 / 8) and rounds[0].mean_reward == pytest.approx(3 / 8)
    assert rounds[1].success_rate == pytest.approx(0.75) and rounds[1].mean_reward == pytest.approx(3.5 / 4)
    # Evaluation never touches the trajectories the learner samples.
    assert buffer.stats().stored_trajectories == 0 and buffer.sample(8, timeout=0.1) is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"episodes": 0}, "episodes"),
        ({"success_sum": 5.0}, "success_sum"),
        ({"reward_sum": float("nan")}, "reward_sum"),
        ({"failed_episodes": 5}, "failed_episodes"),
        ({"policy_version": -1}, "policy_version"),
        ({"report_id": ""}, "report_id"),
    ],
)
def test_bad_reports_are_invalid_argument_naming_the_field(buffer: BufferClient, fields: dict[str, object], named: str) -> None:
    request = buffer_pb2.ReportEvalRequest(report_id="a/0", policy_version=0, episodes=4, reward_sum=1.0, success_sum=1.0)
    for name, value in fields.items():
        setattr(request, name, value)
    with pytest.raises(grpc.RpcError) as error:
        buffer._report_eval(request, timeout=5.0)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in (error.value.details() or "")
    assert list(buffer.stats().eval_rounds) == []


def test_only_the_newest_rounds_are_kept() -> None:
    book = EvalBook(keep=3)
    for version in (0, 10, 20, 30, 5):
        book.report(buffer_pb2.ReportEvalRequest(report_id=f"a/{version}", policy_version=version, episodes=1))
    assert [r.policy_version for r in book.rounds()] == [10, 20, 30]
