from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResetRequest(_message.Message):
    __slots__ = ("environment", "options_json", "task_id", "seed", "step_latency")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEP_LATENCY_FIELD_NUMBER: _ClassVar[int]
    environment: str
    options_json: str
    task_id: str
    seed: int
    step_latency: StepLatency
    def __init__(self, environment: _Optional[str] = ..., options_json: _Optional[str] = ..., task_id: _Optional[str] = ..., seed: _Optional[int] = ..., step_latency: _Optional[_Union[StepLatency, _Mapping]] = ...) -> None: ...

class StepLatency(_message.Message):
    __slots__ = ("distribution", "seconds")
    DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    distribution: str
    seconds: float
    def __init__(self, distribution: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("text", "info_json")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    text: str
    info_json: str
    def __init__(self, text: _Optional[str] = ..., info_json: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("action",)
    ACTION_FIELD_NUMBER: _ClassVar[int]
    action: str
    def __init__(self, action: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("observation", "reward", "terminated", "truncated")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    observation: Observation
    reward: float
    terminated: bool
    truncated: bool
    def __init__(self, observation: _Optional[_Union[Observation, _Mapping]] = ..., reward: _Optional[float] = ..., terminated: _Optional[bool] = ..., truncated: _Optional[bool] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("uptime_seconds",)
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    uptime_seconds: float
    def __init__(self, uptime_seconds: _Optional[float] = ...) -> None: ...
