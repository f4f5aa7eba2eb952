"""Validation of one wire trajectory: the structural checks every consumer relies on
(``stoker.trajectory.array_problem``) plus the buffer's service limits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, cast

import numpy as np
from google.protobuf.message import DecodeError

from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import WireError, split_fields
from stoker.trajectory import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_ARRAYS, VERSION_DTYPE, array_problem
from stoker.v1 import trajectory_pb2

def parse(raw: bytes | memoryview) -> trajectory_pb2.Trajectory:
    """Parse a serialized trajectory; the runtime reads any buffer (a slice of the request) in place."""
    return trajectory_pb2.Trajectory.FromString(cast(bytes, raw))


# Trajectories at least this long are validated without copying their arrays (see validate_batch).
LONG_TOKENS = 4096
_BYTES_PER_TOKEN = sum(dtype.itemsize for _, dtype in TOKEN_ARRAYS)
_ID_SIZE = dict(TOKEN_ARRAYS)["token_ids"].itemsize
_ARRAY_FIELDS = frozenset({7, 8, 9, 10})  # token_ids, loss_mask, logprobs, policy_versions

OK_STATUSES = (trajectory_pb2.EPISODE_STATUS_OK, trajectory_pb2.EPISODE_STATUS_TRUNCATED)
FAILED_STATUSES = (trajectory_pb2.EPISODE_STATUS_FAILED, trajectory_pb2.EPISODE_STATUS_TIMEOUT)


class TrajectoryMeta(NamedTuple):
    """What the buffer keeps in memory besides the raw bytes (a tuple: built once per trajectory
    on the Put path, where a frozen dataclass's ``__init__`` costs several times as much)."""

    episode_id: str
    group_id: str
    group_size: int
    actor_id: str
    ok: bool  # status ok or truncated; failed/timed-out episodes never train
    oldest_version: int  # the oldest policy version among model tokens; -1 when there are none
    num_tokens: int


class Invalid(ValueError):
    """A trajectory the buffer refuses; ``field`` names the offending proto field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _oldest_version(message: trajectory_pb2.Trajectory) -> int | None:
    """The smallest policy version among model tokens, None when there are none."""
    if not message.num_tokens:
        return None
    mask = np.frombuffer(message.loss_mask, MASK_DTYPE).view(bool)
    versions = np.frombuffer(message.policy_versions, VERSION_DTYPE)[mask]
    return int(versions.min()) if versions.size else None


def parse_meta(raw: bytes | memoryview) -> TrajectoryMeta:
    """Metadata of an already validated trajectory (log replay: the checksum vouches for it)."""
    message = parse(raw)
    return _meta(message, _oldest_version(message))


def _meta(message: trajectory_pb2.Trajectory, oldest: int | None) -> TrajectoryMeta:
    return TrajectoryMeta(
        episode_id=message.episode_id,
        group_id=message.group_id,
        group_size=message.group_size,
        actor_id=message.actor_id,
        ok=message.status in OK_STATUSES,
        oldest_version=-1 if oldest is None else oldest,
        num_tokens=message.num_tokens,
    )


def _check_scalars(message: trajectory_pb2.Trajectory, settings: BufferSettings) -> None:
    """Ids, limits and group size: everything but the per-token arrays."""
    for name in ("episode_id", "group_id"):
        value = getattr(message, name)
        if not value:
            raise Invalid(name, "empty; expected a unique id")
    for name in ("episode_id", "group_id", "task_id", "actor_id"):
        size = len(getattr(message, name))
        if size > settings.max_id_length:
            raise Invalid(name, f"{size} characters; expected at most {settings.max_id_length}")
    if len(message.status_reason) > settings.max_text_length:
        raise Invalid("status_reason", f"{len(message.status_reason)} characters; expected at most {settings.max_text_length}")
    if message.group_size < 1:
        raise Invalid("group_size", "0; expected the number of episodes in the group")
    if settings.group_size and message.group_size != settings.group_size:
        raise Invalid("group_size", f"got {message.group_size}; expected {settings.group_size} (buffer.groupSize)")
    if message.num_tokens > settings.max_trajectory_tokens:
        raise Invalid("num_tokens", f"{message.num_tokens} tokens; expected at most {settings.max_trajectory_tokens}")
    if len(message.turn_rewards) > settings.max_trajectory_tokens:
        raise Invalid("turn_rewards", f"{len(message.turn_rewards)} entries; expected at most one per token")
    if len(message.metrics) > settings.max_metrics:
        raise Invalid("metrics", f"{len(message.metrics)} entries; expected at most {settings.max_metrics}")
    if not math.isfinite(message.reward):
        raise Invalid("reward", f"{message.reward}; expected a finite number")
    if message.turn_rewards and not np.isfinite(np.asarray(message.turn_rewards, LOGPROB_DTYPE)).all():
        raise Invalid("turn_rewards", "non-finite values (NaN or inf)")


def validate(raw: bytes | memoryview, settings: BufferSettings) -> TrajectoryMeta:
    """Check one serialized trajectory; return its metadata or raise ``Invalid`` naming the field."""
    try:
        message = parse(raw)
    except DecodeError as exc:
        raise Invalid("trajectory", f"not a well-formed stoker.v1.Trajectory ({exc})") from None
    _check_scalars(message, settings)
    problem = array_problem(message)
    if problem is not None:
        raise Invalid(*problem)
    oldest = _oldest_version(message)
    if oldest is not None and oldest < 0:
        raise Invalid("policy_versions", f"version {oldest} on a model token (loss_mask = 1); expected >= 0")
    return _meta(message, oldest)


def _scalar_problem(message: trajectory_pb2.Trajectory, settings: BufferSettings) -> Invalid | None:
    """The per-field checks that need no array maths, in ``validate``'s order."""
    try:
        _check_scalars(message, settings)
    except Invalid as exc:
        return exc
    return None


def _scalars_plainly_ok(m: trajectory_pb2.Trajectory, settings: BufferSettings) -> bool:
    """True when ``_check_scalars`` would pass, checked in one expression (the batch path's common
    case; any False goes to the per-item checks, which name the field)."""
    limit = settings.max_id_length
    return bool(
        m.episode_id
        and m.group_id
        and len(m.episode_id) <= limit
        and len(m.group_id) <= limit
        and len(m.task_id) <= limit
        and len(m.actor_id) <= limit
        and len(m.status_reason) <= settings.max_text_length
        and m.group_size >= 1
        and (not settings.group_size or m.group_size == settings.group_size)
        and m.num_tokens <= settings.max_trajectory_tokens
        and len(m.turn_rewards) <= settings.max_trajectory_tokens
        and len(m.metrics) <= settings.max_metrics
        and math.isfinite(m.reward)
        and (not m.turn_rewards or bool(np.isfinite(np.asarray(m.turn_rewards, LOGPROB_DTYPE)).all()))
    )


def validate_batch(raws: Sequence[bytes | memoryview], settings: BufferSettings) -> list[TrajectoryMeta | Invalid]:
    """``validate`` for a whole Put batch: the same answer for every item, but the array checks run
    once over the batch's concatenated arrays instead of once per trajectory, which is most of the
    cost for short trajectories. Any failed batch-wide check falls back to ``validate`` per item,
    so error messages are exactly the per-item ones.

    Long trajectories (``LONG_TOKENS`` and up) are checked one by one on zero-copy views of the
    request instead: copying their arrays out would cost more (fresh pages for every copy) than the
    per-call overhead that batching saves."""
    if raws and sum(len(raw) for raw in raws) >= LONG_TOKENS * _BYTES_PER_TOKEN * len(raws):
        return [_validate_long(raw, settings) for raw in raws]
    messages: list[trajectory_pb2.Trajectory] = []
    masks: list[bytes] = []
    logprobs: list[bytes] = []
    versions: list[bytes] = []
    for raw in raws:
        try:
            message = parse(raw)
        except DecodeError:
            return [_validate_or_invalid(raw, settings) for raw in raws]
        n = message.num_tokens
        # Each array is read once: every read of a bytes field makes a new copy.
        mask, logprob, version = message.loss_mask, message.logprobs, message.policy_versions
        if (
            message.status == trajectory_pb2.EPISODE_STATUS_UNSPECIFIED
            or not n
            or not _scalars_plainly_ok(message, settings)
            or len(message.token_ids) != n * _ID_SIZE
            or len(mask) != n * MASK_DTYPE.itemsize
            or len(logprob) != n * LOGPROB_DTYPE.itemsize
            or len(version) != n * VERSION_DTYPE.itemsize
        ):
            return [_validate_or_invalid(raw, settings) for raw in raws]
        messages.append(message)
        masks.append(mask)
        logprobs.append(logprob)
        versions.append(version)
    if not messages:
        return []
    sizes = np.fromiter((m.num_tokens for m in messages), np.int64, len(messages))
    starts = np.zeros(len(messages), np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    mask_all = np.frombuffer(b"".join(masks), MASK_DTYPE)
    logprobs_all = np.frombuffer(b"".join(logprobs), LOGPROB_DTYPE)
    versions_all = np.frombuffer(b"".join(versions), VERSION_DTYPE)
    sampled = mask_all.view(bool)
    model_tokens = np.add.reduceat(mask_all, starts, dtype=np.int64)
    failed = np.fromiter((m.status in FAILED_STATUSES for m in messages), bool, len(messages))
    ok = (
        mask_all.max() <= 1
        and bool((model_tokens > 0)[~failed].all())
        and bool(np.isfinite(logprobs_all).all())
        and not bool((logprobs_all[sampled] > 0).any())
    )
    oldest = np.minimum.reduceat(np.where(sampled, versions_all, np.iinfo(np.int32).max), starts)
    if not ok or bool((oldest < 0).any()):
        return [_validate_or_invalid(raw, settings) for raw in raws]
    return [
        _meta(message, int(old) if count else None)
        for message, old, count in zip(messages, oldest.tolist(), model_tokens.tolist(), strict=True)
    ]


def _validate_long(raw: bytes | memoryview, settings: BufferSettings) -> TrajectoryMeta | Invalid:
    """``validate`` without copying the per-token arrays (only the rest of the message is parsed);
    any doubt goes to ``validate`` itself."""
    try:
        arrays, head = split_fields(raw, _ARRAY_FIELDS)
        message = parse(head)
    except (WireError, DecodeError):
        return _validate_or_invalid(raw, settings)
    n = message.num_tokens
    if message.status == trajectory_pb2.EPISODE_STATUS_UNSPECIFIED or not n or _scalar_problem(message, settings):
        return _validate_or_invalid(raw, settings)
    views = [arrays.get(number, memoryview(b"")) for number in sorted(_ARRAY_FIELDS)]
    if any(len(view) != n * dtype.itemsize for view, (_, dtype) in zip(views, TOKEN_ARRAYS, strict=True)):
        return _validate_or_invalid(raw, settings)
    mask = np.frombuffer(views[1], MASK_DTYPE)
    logprobs = np.frombuffer(views[2], LOGPROB_DTYPE)
    versions = np.frombuffer(views[3], VERSION_DTYPE)
    sampled = mask.view(bool)
    has_model_tokens = bool(mask.any())
    if (
        mask.max() > 1
        or (not has_model_tokens and message.status not in FAILED_STATUSES)
        or not np.isfinite(logprobs).all()
        or np.any(logprobs > 0, where=sampled)
    ):
        return _validate_or_invalid(raw, settings)
    oldest = int(np.min(versions, where=sampled, initial=np.iinfo(np.int32).max)) if has_model_tokens else None
    if oldest is not None and oldest < 0:
        return _validate_or_invalid(raw, settings)
    return _meta(message, oldest)


def _validate_or_invalid(raw: bytes | memoryview, settings: BufferSettings) -> TrajectoryMeta | Invalid:
    try:
        return validate(raw, settings)
    except Invalid as exc:
        return exc
