"""What the buffer client's calls return and raise: its errors, the retry policy, Put's summary,
admission credit and sampled batches, with the Sample response's codec (``decode_sample``,
``encode_sample``) and the encoding of what Put takes. ``stoker.buffer.client`` re-exports them."""

from __future__ import annotations

import random
from dataclasses import dataclass

from stoker.buffer.wire import encode_trajectory
from stoker.trajectory import Episode, from_proto, to_proto
from stoker.v1 import buffer_pb2, trajectory_pb2


class BufferClientError(Exception):
    """Base of the client's errors."""


class AuthError(BufferClientError):
    """The buffer refused the bearer token (or none was sent)."""


class BufferUnavailableError(BufferClientError):
    """The buffer stayed unreachable or full until the retry deadline."""


class LeaseLostError(BufferClientError):
    """Commit of a batch the buffer no longer leases; its groups will be delivered again."""


@dataclass(frozen=True)
class Rejection:
    index: int  # position in the list given to put()
    episode_id: str
    field: str  # the offending Trajectory field, e.g. "logprobs"
    message: str

    def __str__(self) -> str:
        who = f"episode {self.episode_id!r}" if self.episode_id else f"trajectory #{self.index}"
        return f"{who}: {self.field}: {self.message}"


class InvalidTrajectoryError(BufferClientError, ValueError):
    """One or more trajectories were refused with INVALID_ARGUMENT; every other one was stored."""

    def __init__(self, rejections: list[Rejection], stored: int):
        head = "; ".join(str(r) for r in rejections[:3])
        more = f" (and {len(rejections) - 3} more)" if len(rejections) > 3 else ""
        super().__init__(f"{len(rejections)} invalid trajectories: {head}{more}")
        self.rejections = rejections
        self.stored = stored

    @property
    def fields(self) -> list[str]:
        return [r.field for r in self.rejections]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: sleep ``uniform(0, min(maximum, initial * multiplier**n))``,
    at least the server's retry hint, until ``deadline`` seconds have passed."""

    initial: float = 0.05
    maximum: float = 2.0
    multiplier: float = 2.0
    deadline: float = 120.0

    def delay(self, attempt: int, hint: float = 0.0) -> float:
        ceiling = min(self.maximum, self.initial * self.multiplier**attempt)
        return max(hint, random.uniform(0.0, ceiling))


@dataclass(frozen=True)
class PutSummary:
    stored: int
    duplicates: int  # already stored earlier (a retry): not stored twice


@dataclass(frozen=True)
class Credit:
    granted: int
    policy_version: int
    retry_after_seconds: float


@dataclass
class SampledGroup:
    group_id: str
    masked: bool  # holds a failed/timed-out episode (status != ok/truncated): never train on those
    episodes: list[Episode]


@dataclass
class SampledBatch:
    batch_id: str
    groups: list[SampledGroup]
    policy_version: int
    max_staleness: int | None = None  # the buffer's limit for this batch; None from a buffer without Configure

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g.episodes]


Encodable = Episode | trajectory_pb2.Trajectory | bytes


def decode_sample(response: buffer_pb2.SampleResponse) -> SampledBatch | None:
    """A Sample response as arrays; None when it holds no batch (nothing arrived in time)."""
    if not response.batch_id:
        return None
    return SampledBatch(
        response.batch_id,
        [SampledGroup(g.group_id, g.masked, [from_proto(t) for t in g.trajectories]) for g in response.groups],
        response.policy_version,
        response.max_staleness if response.HasField("max_staleness") else None,
    )


def encode_sample(batch: SampledBatch) -> buffer_pb2.SampleResponse:
    """Inverse of ``decode_sample``: the batch as the buffer sent it."""
    return buffer_pb2.SampleResponse(
        batch_id=batch.batch_id,
        groups=[
            buffer_pb2.Group(group_id=g.group_id, masked=g.masked, trajectories=[to_proto(e) for e in g.episodes])
            for g in batch.groups
        ],
        policy_version=batch.policy_version,
        max_staleness=batch.max_staleness,
    )


def encode_item(item: Encodable) -> bytes:
    if isinstance(item, Episode):
        return encode_trajectory(item)
    if isinstance(item, trajectory_pb2.Trajectory):
        return item.SerializeToString()
    return bytes(item)


def episode_id_of(item: Encodable) -> str:
    if isinstance(item, (Episode, trajectory_pb2.Trajectory)):
        return item.episode_id
    return ""
