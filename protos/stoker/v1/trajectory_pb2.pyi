from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EpisodeStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EPISODE_STATUS_UNSPECIFIED: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_OK: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_TRUNCATED: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_FAILED: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_TIMEOUT: _ClassVar[EpisodeStatus]
EPISODE_STATUS_UNSPECIFIED: EpisodeStatus
EPISODE_STATUS_OK: EpisodeStatus
EPISODE_STATUS_TRUNCATED: EpisodeStatus
EPISODE_STATUS_FAILED: EpisodeStatus
EPISODE_STATUS_TIMEOUT: EpisodeStatus

class Timings(_message.Message):
    __slots__ = ("started_unix", "finished_unix", "sample_seconds", "environment_seconds")
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    started_unix: float
    finished_unix: float
    sample_seconds: float
    environment_seconds: float
    def __init__(self, started_unix: _Optional[float] = ..., finished_unix: _Optional[float] = ..., sample_seconds: _Optional[float] = ..., environment_seconds: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("episode_id", "group_id", "group_size", "task_id", "actor_id", "num_tokens", "token_ids", "loss_mask", "logprobs", "policy_versions", "turn_rewards", "reward", "status", "status_reason", "num_turns", "timings", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    group_id: str
    group_size: int
    task_id: str
    actor_id: str
    num_tokens: int
    token_ids: bytes
    loss_mask: bytes
    logprobs: bytes
    policy_versions: bytes
    turn_rewards: _containers.RepeatedScalarFieldContainer[float]
    reward: float
    status: EpisodeStatus
    status_reason: str
    num_turns: int
    timings: Timings
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, episode_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., task_id: _Optional[str] = ..., actor_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., policy_versions: _Optional[bytes] = ..., turn_rewards: _Optional[_Iterable[float]] = ..., reward: _Optional[float] = ..., status: _Optional[_Union[EpisodeStatus, str]] = ..., status_reason: _Optional[str] = ..., num_turns: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...
