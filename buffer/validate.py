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
KNOWN_STATUSES = frozenset(OK_STATUSES + FAILED_STATUSES)


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
    if message.status not in KNOWN_STATUSES and message.status != trajectory_pb2.EPISODE_STATUS_UNSPECIFIED:
        raise Invalid("status", f"got {message.status}; expected one of {sorted(KNOWN_STATUSES)} (EpisodeStatus)")
    if len(message.turn_rewards) > message.num_tokens:
        raise Invalid("turn_rewards", f"{len(message.turn_rewards)} entries for {message.num_tokens} tokens; expected at most one per token")
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


def _head_limit(settings: BufferSettings) -> int:
    """Bytes of a trajectory besides its per-token arrays below which every id, text, map and
    list in it is within the limits (a string of b bytes has at most b characters, a map entry or
    a float takes at least two bytes on the wire): the batch path checks one length instead of each,
    and runs ``_check_scalars`` only for messages above it."""
    return min(settings.max_id_length, settings.max_text_length, 2 * settings.max_metrics, 2 * settings.max_trajectory_tokens)


def validate_batch(raws: Sequence[bytes | memoryview], settings: BufferSettings) -> list[TrajectoryMeta | Invalid]:
    """``validate`` for a whole Put batch: the same answer for every item, but the array checks run
    once over the batch's concatenated arrays instead of once per trajectory, and each field is read
    once, which is most of the cost for short trajectories. Any failed check falls back to
    ``validate`` per item, so error messages are exactly the per-item ones.

    Long trajectories (``LONG_TOKENS`` and up) are checked one by one on zero-copy views of the
    request instead: copying their arrays out would cost more (fresh pages for every copy) than the
    per-call overhead that batching saves."""
    if raws and sum(len(raw) for raw in raws) >= LONG_TOKENS * _BYTES_PER_TOKEN * len(raws):
        return [_validate_long(raw, settings) for raw in raws]
    head_limit = _head_limit(settings)
    max_tokens, group_size = settings.max_trajectory_tokens, settings.group_size
    heads: list[tuple[str, str, int, str, bool, int, bool]] = []
    masks: list[bytes] = []
    logprobs: list[bytes] = []
    versions: list[bytes] = []
    starts: list[int] = []
    total = 0
    for raw in raws:
        try:
            m = parse(raw)
        except DecodeError:
            return [_validate_or_invalid(raw, settings) for raw in raws]
        # Each field is read once: every read of a bytes field makes a new copy.
        n, status, mask, logprob, version = m.num_tokens, m.status, m.loss_mask, m.logprobs, m.policy_versions
        episode_id, group_id, size = m.episode_id, m.group_id, m.group_size
        has_model_tokens = b"\x01" in mask
        turn_rewards = m.turn_rewards
        if (
            not 0 < n <= max_tokens
            or status not in KNOWN_STATUSES
            or len(turn_rewards) > n
            or not episode_id
            or not group_id
            or size < 1
            or (group_size and size != group_size)
            or (len(raw) - n * _BYTES_PER_TOKEN > head_limit and _scalar_problem(m, settings) is not None)
            or len(m.token_ids) != n * _ID_SIZE
            or len(mask) != n
            or len(logprob) != n * LOGPROB_DTYPE.itemsize
            or len(version) != n * VERSION_DTYPE.itemsize
            or not (has_model_tokens or status in FAILED_STATUSES)
            or not math.isfinite(m.reward)
            or (turn_rewards and not np.isfinite(np.asarray(turn_rewards, LOGPROB_DTYPE)).all())
        ):
            return [_validate_or_invalid(raw, settings) for raw in raws]
        heads.append((episode_id, group_id, size, m.actor_id, status in OK_STATUSES, n, has_model_tokens))
        masks.append(mask)
        logprobs.append(logprob)
        versions.append(version)
        starts.append(total)
        total += n
    if not heads:
        return []
    mask_all = b"".join(masks)
    if mask_all.translate(None, b"\x00\x01"):  # values other than 0 and 1
        return [_validate_or_invalid(raw, settings) for raw in raws]
    sampled = np.frombuffer(mask_all, bool)
    logprobs_all = np.frombuffer(b"".join(logprobs), LOGPROB_DTYPE)
    # Env tokens' log-probs become 0 here but NaN if not finite (inf * 0 is NaN too), and max/min
    # propagate NaN: one pass finds any non-finite value and any positive one on a model token.
    with np.errstate(invalid="ignore"):
        on_model_tokens = logprobs_all * sampled
    if not (on_model_tokens.max() <= 0 and on_model_tokens.min() > -math.inf):
        return [_validate_or_invalid(raw, settings) for raw in raws]
    versions_all = np.frombuffer(b"".join(versions), VERSION_DTYPE)
    oldest = np.minimum.reduceat(np.where(sampled, versions_all, np.iinfo(np.int32).max), starts).tolist()
    if any(old < 0 for old in oldest):
        return [_validate_or_invalid(raw, settings) for raw in raws]
    return [
        TrajectoryMeta(episode_id, group_id, size, actor_id, ok, old if has else -1, n)
        for (episode_id, group_id, size, actor_id, ok, n, has), old in zip(heads, oldest, strict=True)
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
    if message.status not in KNOWN_STATUSES or not n or _scalar_problem(message, settings):
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
