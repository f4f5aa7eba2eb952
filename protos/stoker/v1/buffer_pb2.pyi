from stoker.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutRequest(_message.Message):
    __slots__ = ("client_id", "trajectories")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Trajectory]
    def __init__(self, client_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_trajectory_pb2.Trajectory, _Mapping]]] = ...) -> None: ...

class PutResult(_message.Message):
    __slots__ = ("code", "field", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    field: str
    message: str
    def __init__(self, code: _Optional[int] = ..., field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results", "stored", "duplicates")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutResult]
    stored: int
    duplicates: int
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ..., stored: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class PutStreamRequest(_message.Message):
    __slots__ = ("client_id", "trajectories", "sequence")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Trajectory]
    sequence: int
    def __init__(self, client_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_trajectory_pb2.Trajectory, _Mapping]]] = ..., sequence: _Optional[int] = ...) -> None: ...

class PutAck(_message.Message):
    __slots__ = ("sequence", "code", "message", "stored", "duplicates", "results", "retry_after_ms")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    code: int
    message: str
    stored: int
    duplicates: int
    results: _containers.RepeatedCompositeFieldContainer[PutResult]
    retry_after_ms: int
    def __init__(self, sequence: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., results: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class PutStreamResponse(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[PutAck]
    def __init__(self, acks: _Optional[_Iterable[_Union[PutAck, _Mapping]]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("actor_id", "groups", "load", "timeout_seconds")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    groups: int
    load: ActorLoad
    timeout_seconds: float
    def __init__(self, actor_id: _Optional[str] = ..., groups: _Optional[int] = ..., load: _Optional[_Union[ActorLoad, _Mapping]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ActorLoad(_message.Message):
    __slots__ = ("cpu_cores", "loop_busy", "episodes_in_flight", "concurrency", "trajectories_per_second")
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    LOOP_BUSY_FIELD_NUMBER: _ClassVar[int]
    EPISODES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    cpu_cores: float
    loop_busy: float
    episodes_in_flight: float
    concurrency: int
    trajectories_per_second: float
    def __init__(self, cpu_cores: _Optional[float] = ..., loop_busy: _Optional[float] = ..., episodes_in_flight: _Optional[float] = ..., concurrency: _Optional[int] = ..., trajectories_per_second: _Optional[float] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("granted", "policy_version", "retry_after_seconds")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    granted: int
    policy_version: int
    retry_after_seconds: float
    def __init__(self, granted: _Optional[int] = ..., policy_version: _Optional[int] = ..., retry_after_seconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("actor_id", "groups")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    groups: int
    def __init__(self, actor_id: _Optional[str] = ..., groups: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("learner_id", "max_groups", "min_groups", "timeout_seconds", "session_id")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MIN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    max_groups: int
    min_groups: int
    timeout_seconds: float
    session_id: str
    def __init__(self, learner_id: _Optional[str] = ..., max_groups: _Optional[int] = ..., min_groups: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., session_id: _Optional[str] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "trajectories", "masked")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Trajectory]
    masked: bool
    def __init__(self, group_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[_trajectory_pb2.Trajectory, _Mapping]]] = ..., masked: _Optional[bool] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("batch_id", "groups", "policy_version", "max_staleness")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    policy_version: int
    max_staleness: int
    def __init__(self, batch_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., policy_version: _Optional[int] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed_trajectories",)
    COMMITTED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    committed_trajectories: int
    def __init__(self, committed_trajectories: _Optional[int] = ...) -> None: ...

class SetPolicyVersionRequest(_message.Message):
    __slots__ = ("policy_version", "learner_duty_cycle")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEARNER_DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    learner_duty_cycle: float
    def __init__(self, policy_version: _Optional[int] = ..., learner_duty_cycle: _Optional[float] = ...) -> None: ...

class SetPolicyVersionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("capacity", "max_staleness")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    max_staleness: int
    def __init__(self, capacity: _Optional[int] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferStats(_message.Message):
    __slots__ = ("capacity", "stored_trajectories", "complete_groups", "incomplete_groups", "leased_batches", "fill", "policy_version", "admission_credit", "in_flight_groups", "accepted_total", "sampled_total", "committed_total", "dropped", "staleness_histogram", "per_actor_accepted", "put_rate", "sample_rate", "stale_incomplete_groups", "rejected", "duplicates_total", "redelivered_groups", "masked_groups_delivered", "committed_groups_total", "log_bytes", "log_segments", "replayed_trajectories", "corrupt_log_tails", "full_rejections", "stored_bytes", "admission_scale", "disk_full", "disk_free_bytes", "disk_full_rejections", "learner_duty_cycle", "max_staleness", "eval_rounds", "actor_loads")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StalenessHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class PerActorAcceptedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ActorLoadsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ActorLoad
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ActorLoad, _Mapping]] = ...) -> None: ...
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STORED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_CREDIT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    PER_ACTOR_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PUT_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    STALE_INCOMPLETE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MASKED_GROUPS_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOG_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_LOG_TAILS_FIELD_NUMBER: _ClassVar[int]
    FULL_REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_SCALE_FIELD_NUMBER: _ClassVar[int]
    DISK_FULL_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FULL_REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    LEARNER_DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACTOR_LOADS_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    stored_trajectories: int
    complete_groups: int
    incomplete_groups: int
    leased_batches: int
    fill: float
    policy_version: int
    admission_credit: int
    in_flight_groups: int
    accepted_total: int
    sampled_total: int
    committed_total: int
    dropped: _containers.ScalarMap[str, int]
    staleness_histogram: _containers.ScalarMap[int, int]
    per_actor_accepted: _containers.ScalarMap[str, int]
    put_rate: float
    sample_rate: float
    stale_incomplete_groups: int
    rejected: _containers.ScalarMap[str, int]
    duplicates_total: int
    redelivered_groups: int
    masked_groups_delivered: int
    committed_groups_total: int
    log_bytes: int
    log_segments: int
    replayed_trajectories: int
    corrupt_log_tails: int
    full_rejections: int
    stored_bytes: int
    admission_scale: float
    disk_full: bool
    disk_free_bytes: int
    disk_full_rejections: int
    learner_duty_cycle: float
    max_staleness: int
    eval_rounds: _containers.RepeatedCompositeFieldContainer[EvalRound]
    actor_loads: _containers.MessageMap[str, ActorLoad]
    def __init__(self, capacity: _Optional[int] = ..., stored_trajectories: _Optional[int] = ..., complete_groups: _Optional[int] = ..., incomplete_groups: _Optional[int] = ..., leased_batches: _Optional[int] = ..., fill: _Optional[float] = ..., policy_version: _Optional[int] = ..., admission_credit: _Optional[int] = ..., in_flight_groups: _Optional[int] = ..., accepted_total: _Optional[int] = ..., sampled_total: _Optional[int] = ..., committed_total: _Optional[int] = ..., dropped: _Optional[_Mapping[str, int]] = ..., staleness_histogram: _Optional[_Mapping[int, int]] = ..., per_actor_accepted: _Optional[_Mapping[str, int]] = ..., put_rate: _Optional[float] = ..., sample_rate: _Optional[float] = ..., stale_incomplete_groups: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ..., duplicates_total: _Optional[int] = ..., redelivered_groups: _Optional[int] = ..., masked_groups_delivered: _Optional[int] = ..., committed_groups_total: _Optional[int] = ..., log_bytes: _Optional[int] = ..., log_segments: _Optional[int] = ..., replayed_trajectories: _Optional[int] = ..., corrupt_log_tails: _Optional[int] = ..., full_rejections: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., admission_scale: _Optional[float] = ..., disk_full: _Optional[bool] = ..., disk_free_bytes: _Optional[int] = ..., disk_full_rejections: _Optional[int] = ..., learner_duty_cycle: _Optional[float] = ..., max_staleness: _Optional[int] = ..., eval_rounds: _Optional[_Iterable[_Union[EvalRound, _Mapping]]] = ..., actor_loads: _Optional[_Mapping[str, ActorLoad]] = ...) -> None: ...

class ReportEvalRequest(_message.Message):
    __slots__ = ("report_id", "policy_version", "episodes", "reward_sum", "success_sum", "failed_episodes")
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    REWARD_SUM_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_SUM_FIELD_NUMBER: _ClassVar[int]
    FAILED_EPISODES_FIELD_NUMBER: _ClassVar[int]
    report_id: str
    policy_version: int
    episodes: int
    reward_sum: float
    success_sum: float
    failed_episodes: int
    def __init__(self, report_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., episodes: _Optional[int] = ..., reward_sum: _Optional[float] = ..., success_sum: _Optional[float] = ..., failed_episodes: _Optional[int] = ...) -> None: ...

class ReportEvalResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvalRound(_message.Message):
    __slots__ = ("policy_version", "episodes", "success_rate", "mean_reward", "reports", "failed_episodes")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_EPISODES_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    episodes: int
    success_rate: float
    mean_reward: float
    reports: int
    failed_episodes: int
    def __init__(self, policy_version: _Optional[int] = ..., episodes: _Optional[int] = ..., success_rate: _Optional[float] = ..., mean_reward: _Optional[float] = ..., reports: _Optional[int] = ..., failed_episodes: _Optional[int] = ...) -> None: ...

class LogConsume(_message.Message):
    __slots__ = ("group_ids", "reason", "episode_ids")
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    episode_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., episode_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LogCheckpoint(_message.Message):
    __slots__ = ("policy_version", "committed_groups", "consumed_episode_ids", "consumed_group_ids")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    committed_groups: int
    consumed_episode_ids: _containers.RepeatedScalarFieldContainer[str]
    consumed_group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, policy_version: _Optional[int] = ..., committed_groups: _Optional[int] = ..., consumed_episode_ids: _Optional[_Iterable[str]] = ..., consumed_group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LogPolicyVersion(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...
