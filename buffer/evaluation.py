"""Held-out evaluation results: one aggregate per round, folded from the actors' ReportEval calls.

Evaluation episodes never enter the trajectory store (nothing samples them); only their sums
travel here. A round is the policy version it was played for (a multiple of
``environment.evalEveryVersions``); every actor that reached it reports its own episodes once, and
the round's rates are over all of them. Rounds live in memory, the newest ``keep`` of them: they
are figures for Stats, the learner's metrics and the RLJob status, and those copies outlive a
buffer restart.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

from stoker.v1 import buffer_pb2

MAX_VERSION = 1 << 40  # as the buffer's policy versions
MAX_EPISODES_PER_REPORT = 1 << 20
MAX_REPORT_ID = 256
ROUNDS_KEPT = 32
REPORT_IDS_KEPT = 4096


class InvalidReport(ValueError):
    """A ReportEval whose fields cannot be an evaluation round (the message names the field)."""


@dataclass
class _Round:
    episodes: int = 0
    reward_sum: float = 0.0
    success_sum: float = 0.0
    failed: int = 0
    reports: int = 0


class EvalBook:
    """Per-round sums of evaluation episodes; ``report`` and ``rounds`` may come from any thread."""

    def __init__(self, keep: int = ROUNDS_KEPT):
        self.keep = keep
        self._rounds: dict[int, _Round] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()  # report ids, for idempotent retries
        self._lock = threading.Lock()

    def report(self, request: buffer_pb2.ReportEvalRequest) -> bool:
        """Fold one actor's round in; False if this report id was already counted."""
        check(request)
        with self._lock:
            if request.report_id in self._seen:
                return False
            self._seen[request.report_id] = None
            while len(self._seen) > REPORT_IDS_KEPT:
                self._seen.popitem(last=False)
            version = int(request.policy_version)
            entry = self._rounds.setdefault(version, _Round())
            entry.episodes += request.episodes
            entry.reward_sum += request.reward_sum
            entry.success_sum += request.success_sum
            entry.failed += request.failed_episodes
            entry.reports += 1
            for old in sorted(self._rounds)[: max(0, len(self._rounds) - self.keep)]:
                del self._rounds[old]
            return True

    def rounds(self) -> list[buffer_pb2.EvalRound]:
        """The rounds kept, oldest first."""
        with self._lock:
            return [
                buffer_pb2.EvalRound(
                    policy_version=version,
                    episodes=entry.episodes,
                    success_rate=entry.success_sum / entry.episodes if entry.episodes else 0.0,
                    mean_reward=entry.reward_sum / entry.episodes if entry.episodes else 0.0,
                    reports=entry.reports,
                    failed_episodes=entry.failed,
                )
                for version, entry in sorted(self._rounds.items())
            ]


def check(request: buffer_pb2.ReportEvalRequest) -> None:
    if not request.report_id or len(request.report_id) > MAX_REPORT_ID:
        raise InvalidReport(f"report_id: {len(request.report_id)} characters; expected 1..{MAX_REPORT_ID}")
    if not 0 <= request.policy_version <= MAX_VERSION:
        raise InvalidReport(f"policy_version: got {request.policy_version}; expected 0..{MAX_VERSION}")
    if not 1 <= request.episodes <= MAX_EPISODES_PER_REPORT:
        raise InvalidReport(f"episodes: got {request.episodes}; expected 1..{MAX_EPISODES_PER_REPORT}")
    if not math.isfinite(request.reward_sum):
        raise InvalidReport(f"reward_sum: got {request.reward_sum}; expected a finite number")
    if not (math.isfinite(request.success_sum) and 0 <= request.success_sum <= request.episodes):
        raise InvalidReport(f"success_sum: got {request.success_sum}; expected 0..episodes ({request.episodes})")
    if request.failed_episodes > request.episodes:
        raise InvalidReport(f"failed_episodes: got {request.failed_episodes}; expected <= episodes ({request.episodes})")
