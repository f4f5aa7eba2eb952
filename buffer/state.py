"""The buffer's in-memory records and its exceptions, shared by the core, the server and replay."""

from __future__ import annotations

from dataclasses import dataclass, field

from stoker.buffer.validate import TrajectoryMeta
from stoker.buffer.wal_format import HEADER, Position

# google.rpc.Code values used in PutResult.code
CODE_OK, CODE_INVALID_ARGUMENT = 0, 3


class BufferFull(Exception):
    """The batch does not fit; nothing was stored. Retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class DiskFull(Exception):
    """The log's volume has no room for the batch; nothing was stored. Commits still go through."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class BatchTooLarge(ValueError):
    """A batch that could never fit, however long the client waits."""


class UnknownBatch(KeyError):
    """Commit of a batch the buffer does not hold a lease for (restarted, expired or committed)."""


class Unavailable(Exception):
    """The buffer cannot durably accept anything (closed, or its log is unusable)."""


@dataclass(slots=True, eq=False)
class Entry:
    meta: TrajectoryMeta
    raw: bytes | memoryview
    segment: int

    @property
    def record_bytes(self) -> int:
        return HEADER.size + len(self.raw)


@dataclass(eq=False)
class Group:
    group_id: str
    size: int
    created: float
    entries: dict[str, Entry] = field(default_factory=dict)
    failed: int = 0
    oldest_version: int = -1  # over model tokens of every episode; -1 = none
    state: str = "incomplete"  # incomplete | ready | leased
    timeout_reported: bool = False

    @property
    def masked(self) -> bool:
        return self.failed > 0


@dataclass(eq=False)
class Lease:
    batch_id: str
    learner_id: str
    session_id: str
    groups: list[Group]
    deadline: float


@dataclass
class PutOutcome:
    results: list[tuple[int, str, str]]  # per trajectory: (google.rpc code, field, message)
    stored: int = 0
    duplicates: int = 0

    @property
    def rejected(self) -> list[tuple[int, str, str]]:
        return [(i, f, m) for i, (c, f, m) in enumerate(self.results) if c == CODE_INVALID_ARGUMENT]


@dataclass(slots=True)
class PendingPut:
    """A Put between ``BufferCore.begin_put`` and ``finish_put``: logged, not yet durable."""

    outcome: PutOutcome
    new: list[tuple[bytes | memoryview, TrajectoryMeta]]  # what it stores, once durable
    logged: Position | None  # the end of its records; None when it logged nothing
    durable_at: Position  # what must be flushed before it is acknowledged
    client_id: str
    incarnation: str = ""  # the sending actor process (``CreditLedger``); "" unknown


@dataclass
class SampledBatch:
    batch_id: str
    groups: list[tuple[str, list[bytes | memoryview], bool]]  # (group id, raw trajectories, masked)
    policy_version: int
    max_staleness: int  # the limit the batch was judged against
