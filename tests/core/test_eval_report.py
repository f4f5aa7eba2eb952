"""The run report shows held-out evaluation apart from training success: a line per figure, a
table per round and its own curve."""

from __future__ import annotations

import json
from pathlib import Path

from stoker.runner.progress import _eval_text
from stoker.runner.report import eval_rounds, write_report


def test_evaluation_rounds_get_their_own_section_and_curve(tmp_path: Path) -> None:
    rows = [
        {"time": 0.0, "step": 1, "policy_version": 1, "success_rate": 0.5},
        {"time": 1.0, "step": 2, "policy_version": 2, "success_rate": 0.5, "eval_policy_version": 0,
         "eval_success_rate": 0.1, "eval_reward_mean": 0.2, "eval_episodes": 4},
        {"time": 2.0, "step": 3, "policy_version": 3, "success_rate": 0.6, "eval_policy_version": 0,
         "eval_success_rate": 0.125, "eval_reward_mean": 0.25, "eval_episodes": 8},  # round 0 grew
        {"time": 3.0, "step": 4, "policy_version": 12, "success_rate": 0.7, "eval_policy_version": 10,
         "eval_success_rate": 0.75, "eval_reward_mean": 0.8, "eval_episodes": 8},
    ]
    (tmp_path / "learner_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert eval_rounds(rows) == [(0, 0.125, 0.25, 8), (10, 0.75, 0.8, 8)]
    report = write_report(tmp_path).read_text()
    assert "## Held-out evaluation" in report
    assert "success: 0.125 at v0 -> 0.750 at v10 (8 episodes)" in report
    assert "| 10 | 0.750 | 0.800 | 8 |" in report
    assert (tmp_path / "plots" / "eval_success.png").exists()


def test_a_run_without_evaluation_has_no_such_section(tmp_path: Path) -> None:
    (tmp_path / "learner_metrics.jsonl").write_text(json.dumps({"time": 0.0, "step": 1, "success_rate": 0.5}) + "\n")
    assert "Held-out" not in write_report(tmp_path).read_text()
    assert _eval_text({}) == "-"
    assert _eval_text({"eval_rounds": [{"policy_version": 20, "episodes": 10, "success_rate": 0.8}]}) == "0.800 at v20 (10 episodes)"
