"""Trajectories as numpy arrays, and their exact wire form (``stoker.v1.Trajectory``).

Actors build an ``Episode``, the buffer validates the wire message, the learner decodes it back to
arrays. The per-token arrays are packed little-endian bytes on the wire (see trajectory.proto), so
conversion is a memcpy each way and never re-tokenises anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stoker.v1 import trajectory_pb2

TOKEN_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
LOGPROB_DTYPE = np.dtype("<f4")
VERSION_DTYPE = np.dtype("<i4")

# (proto field, dtype) for every per-token array; each must hold exactly num_tokens elements.
TOKEN_ARRAYS: tuple[tuple[str, np.dtype], ...] = (
    ("token_ids", TOKEN_DTYPE),
    ("loss_mask", MASK_DTYPE),
    ("logprobs", LOGPROB_DTYPE),
    ("policy_versions", VERSION_DTYPE),
)

Status = trajectory_pb2.EpisodeStatus


@dataclass
class Episode:
    """One finished episode, token for token."""

    episode_id: str
    group_id: str
    group_size: int
    task_id: str
    token_ids: np.ndarray  # int32[T]
    loss_mask: np.ndarray  # uint8[T]: 1 = sampled by the model
    logprobs: np.ndarray  # float32[T]: behaviour log-probs, 0 where mask = 0
    policy_versions: np.ndarray  # int32[T]: version each token was sampled with, -1 where mask = 0
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    status: int = trajectory_pb2.EPISODE_STATUS_OK
    status_reason: str = ""
    num_turns: int = 0
    actor_id: str = ""
    started_unix: float = 0.0
    finished_unix: float = 0.0
    sample_seconds: float = 0.0
    environment_seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def ok(self) -> bool:
        return self.status in (trajectory_pb2.EPISODE_STATUS_OK, trajectory_pb2.EPISODE_STATUS_TRUNCATED)

    def oldest_version(self) -> int:
        """The oldest policy version any model token was sampled with (-1 if none)."""
        sampled = self.policy_versions[self.loss_mask.astype(bool)]
        return int(sampled.min()) if sampled.size else -1


def to_proto(episode: Episode) -> trajectory_pb2.Trajectory:
    return trajectory_pb2.Trajectory(
        episode_id=episode.episode_id,
        group_id=episode.group_id,
        group_size=episode.group_size,
        task_id=episode.task_id,
        actor_id=episode.actor_id,
        num_tokens=episode.num_tokens,
        token_ids=np.ascontiguousarray(episode.token_ids, TOKEN_DTYPE).tobytes(),
        loss_mask=np.ascontiguousarray(episode.loss_mask, MASK_DTYPE).tobytes(),
        logprobs=np.ascontiguousarray(episode.logprobs, LOGPROB_DTYPE).tobytes(),
        policy_versions=np.ascontiguousarray(episode.policy_versions, VERSION_DTYPE).tobytes(),
        turn_rewards=episode.turn_rewards,
        reward=episode.reward,
        status=episode.status,  # type: ignore[arg-type]
        status_reason=episode.status_reason,
        num_turns=episode.num_turns,
        timings=trajectory_pb2.Timings(
            started_unix=episode.started_unix,
            finished_unix=episode.finished_unix,
            sample_seconds=episode.sample_seconds,
            environment_seconds=episode.environment_seconds,
        ),
        metrics=episode.metrics,
    )


def from_proto(message: trajectory_pb2.Trajectory) -> Episode:
    """Decode a (validated) wire trajectory; arrays are read-only views of the message bytes."""
    return Episode(
        episode_id=message.episode_id,
        group_id=message.group_id,
        group_size=message.group_size,
        task_id=message.task_id,
        actor_id=message.actor_id,
        token_ids=np.frombuffer(message.token_ids, TOKEN_DTYPE),
        loss_mask=np.frombuffer(message.loss_mask, MASK_DTYPE),
        logprobs=np.frombuffer(message.logprobs, LOGPROB_DTYPE),
        policy_versions=np.frombuffer(message.policy_versions, VERSION_DTYPE),
        reward=message.reward,
        turn_rewards=list(message.turn_rewards),
        status=message.status,
        status_reason=message.status_reason,
        num_turns=message.num_turns,
        started_unix=message.timings.started_unix,
        finished_unix=message.timings.finished_unix,
        sample_seconds=message.timings.sample_seconds,
        environment_seconds=message.timings.environment_seconds,
        metrics=dict(message.metrics),
    )


def array_problem(message: trajectory_pb2.Trajectory) -> tuple[str, str] | None:
    """The first structural problem of a wire trajectory as ``(field, message)``, or None.

    Checks what every consumer relies on: non-empty, each per-token array exactly ``num_tokens``
    long, a mask of 0/1, finite log-probs. Service-level limits (size, group size) are the
    buffer's to add.
    """
    n = message.num_tokens
    # A failed or timed-out episode may have no tokens at all (its sandbox died at reset); it is
    # still submitted so its group completes, and it never trains.
    failed = message.status in (trajectory_pb2.EPISODE_STATUS_FAILED, trajectory_pb2.EPISODE_STATUS_TIMEOUT)
    if message.status == trajectory_pb2.EPISODE_STATUS_UNSPECIFIED:
        return "status", "unspecified; expected ok, truncated, failed or timeout"
    if n == 0 and not failed:
        return "num_tokens", "empty trajectory; expected at least one token"
    for name, dtype in TOKEN_ARRAYS:
        size = len(getattr(message, name))
        if size != n * dtype.itemsize:
            return name, f"{size} bytes; expected {n} x {dtype.itemsize} bytes ({dtype.name}) for num_tokens={n}"
    mask = np.frombuffer(message.loss_mask, MASK_DTYPE)
    if n and mask.max() > 1:
        return "loss_mask", "values other than 0 and 1"
    if not mask.any() and not failed:
        return "loss_mask", "no model tokens (all zeros); nothing to train on"
    logprobs = np.frombuffer(message.logprobs, LOGPROB_DTYPE)
    if not np.isfinite(logprobs).all():
        return "logprobs", "non-finite values (NaN or inf)"
    if (logprobs[mask.astype(bool)] > 0).any():
        return "logprobs", "positive log-probabilities"
    return None
