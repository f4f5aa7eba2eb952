from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LatestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightsInfo(_message.Message):
    __slots__ = ("policy_version", "size_bytes", "sha256", "sharded")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SHARDED_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    size_bytes: int
    sha256: str
    sharded: bool
    def __init__(self, policy_version: _Optional[int] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., sharded: _Optional[bool] = ...) -> None: ...

class ShardManifest(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: bytes
    def __init__(self, manifest: _Optional[bytes] = ...) -> None: ...

class ReadShardRequest(_message.Message):
    __slots__ = ("policy_version", "key", "offset", "size")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    key: str
    offset: int
    size: int
    def __init__(self, policy_version: _Optional[int] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class RelaysRequest(_message.Message):
    __slots__ = ("policy_version", "layout", "address", "stream")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    layout: str
    address: str
    stream: str
    def __init__(self, policy_version: _Optional[int] = ..., layout: _Optional[str] = ..., address: _Optional[str] = ..., stream: _Optional[str] = ...) -> None: ...

class RelaysReply(_message.Message):
    __slots__ = ("upstream", "upstream_streams")
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    upstream: _containers.RepeatedScalarFieldContainer[str]
    upstream_streams: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, upstream: _Optional[_Iterable[str]] = ..., upstream_streams: _Optional[_Iterable[str]] = ...) -> None: ...

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
