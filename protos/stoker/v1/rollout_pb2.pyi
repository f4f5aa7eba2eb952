from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_ids", "max_new_tokens", "stop_token_ids", "session", "pin_weights", "greedy")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PIN_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    session: str
    pin_weights: bool
    greedy: bool
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., session: _Optional[str] = ..., pin_weights: _Optional[bool] = ..., greedy: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "policy_versions", "finished")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStats(_message.Message):
    __slots__ = ("policy_version", "live_versions", "tokens_per_second", "queue_depth", "running", "max_batch", "batch_occupancy", "kv_cache_bytes_used", "kv_cache_bytes_total", "requests_total", "rejected_total", "ready")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIVE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    live_versions: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_second: float
    queue_depth: int
    running: int
    max_batch: int
    batch_occupancy: float
    kv_cache_bytes_used: int
    kv_cache_bytes_total: int
    requests_total: int
    rejected_total: int
    ready: bool
    def __init__(self, policy_version: _Optional[int] = ..., live_versions: _Optional[_Iterable[int]] = ..., tokens_per_second: _Optional[float] = ..., queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., max_batch: _Optional[int] = ..., batch_occupancy: _Optional[float] = ..., kv_cache_bytes_used: _Optional[int] = ..., kv_cache_bytes_total: _Optional[int] = ..., requests_total: _Optional[int] = ..., rejected_total: _Optional[int] = ..., ready: _Optional[bool] = ...) -> None: ...
