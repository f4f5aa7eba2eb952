from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LatestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightsInfo(_message.Message):
    __slots__ = ("policy_version", "size_bytes", "sha256")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    size_bytes: int
    sha256: str
    def __init__(self, policy_version: _Optional[int] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("policy_version", "offset", "data", "size_bytes", "sha256")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    offset: int
    data: bytes
    size_bytes: int
    sha256: str
    def __init__(self, policy_version: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...
