"""The buffer's one settings dataclass, derived from the RLJob spec."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from stoker.spec import RLJobSpec
from stoker.spec_learner import MAX_STALENESS

SyncPolicy = Literal["batch", "none"]
FailedGroupPolicy = Literal["mask", "discard"]
SampleOrder = Literal["oldest-first", "newest-first"]

# Set by the operator on the buffer's container: the mounted ConfigMap file holding
# ``{"admissionScale": x}`` (see ``stoker.operator.manifests.ADMISSION_FILE``).
ADMISSION_FILE_ENV = "STOKER_ADMISSION_FILE"


@dataclass(frozen=True)
class BufferSettings:
    """Everything the buffer service needs to know; ``from_spec`` is the normal way to build one.

    Capacity counts trajectories (episodes); admission credit counts groups.
    """

    capacity: int = 4096
    group_size: int = 8  # every trajectory must declare exactly this group size; 0 accepts any
    max_staleness: int = 4
    batch_groups: int = 4  # learner.batchGroups: groups per training step (the AReaL rule's batch)
    sync: SyncPolicy = "batch"  # batch: fsync before acknowledging each Put/Commit; none: leave it to the OS
    failed_group_policy: FailedGroupPolicy = "mask"
    sample_order: SampleOrder = "oldest-first"
    group_timeout_seconds: float = 600.0
    # A leased batch not committed within this time (with no call from its learner) is redelivered.
    lease_timeout_seconds: float = 600.0
    # Service limits on one trajectory; the gRPC message limit bounds a whole request.
    max_trajectory_tokens: int = 1 << 20
    max_id_length: int = 256
    max_text_length: int = 4096
    max_metrics: int = 256
    max_message_bytes: int = 256 * 1024 * 1024
    # The log rolls to a new segment file after this many bytes; compaction works segment-wise.
    segment_bytes: int = 256 * 1024 * 1024
    # Log space kept preallocated for Commits (and version records) when Puts fill the volume.
    disk_reserve_bytes: int = 8 * 1024 * 1024
    # Consumed episode ids remembered (also across restarts) so a late retry is not stored again.
    dedup_memory: int = 1 << 17
    # Hint sent with RESOURCE_EXHAUSTED (buffer full) and with a zero Acquire grant.
    retry_after_seconds: float = 0.05
    # The operator's admission control file (JSON ``{"admissionScale": x}``, 0 < x <= 1); None = scale 1.
    admission_file: str | None = None
    # How often, at most, the file's mtime is checked (Kubernetes refreshes ConfigMaps in ~1 min).
    admission_check_seconds: float = 1.0

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.capacity >= 1, f"capacity: got {self.capacity}; expected >= 1"),
            (self.group_size >= 0, f"group_size: got {self.group_size}; expected >= 0"),
            (
                0 <= self.max_staleness <= MAX_STALENESS,
                f"max_staleness: got {self.max_staleness}; expected 0..{MAX_STALENESS}",
            ),
            (
                self.group_size == 0 or self.capacity >= self.group_size,
                f"capacity: got {self.capacity}; expected >= group_size ({self.group_size}): a full buffer must hold a complete group",
            ),
            (self.batch_groups >= 1, f"batch_groups: got {self.batch_groups}; expected >= 1"),
            (self.sync in ("batch", "none"), f"sync: got {self.sync!r}; expected 'batch' or 'none'"),
            (
                self.failed_group_policy in ("mask", "discard"),
                f"failed_group_policy: got {self.failed_group_policy!r}; expected 'mask' or 'discard'",
            ),
            (
                self.sample_order in ("oldest-first", "newest-first"),
                f"sample_order: got {self.sample_order!r}; expected 'oldest-first' or 'newest-first'",
            ),
            (self.group_timeout_seconds > 0, "group_timeout_seconds: expected > 0"),
            (self.lease_timeout_seconds > 0, "lease_timeout_seconds: expected > 0"),
            (self.max_trajectory_tokens >= 1, "max_trajectory_tokens: expected >= 1"),
            (self.segment_bytes >= 4096, "segment_bytes: expected >= 4096"),
            (self.disk_reserve_bytes >= 4096, "disk_reserve_bytes: expected >= 4096"),
            (self.max_message_bytes >= 1024, "max_message_bytes: expected >= 1024"),
            (self.admission_check_seconds >= 0, "admission_check_seconds: expected >= 0"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_spec(cls, spec: RLJobSpec, *, environ: Mapping[str, str] | None = None, **overrides: Any) -> BufferSettings:
        """Settings for the job's buffer; ``overrides`` replace individual fields (tests, CLI).

        The admission file is deployment plumbing rather than job configuration, so it comes from
        ``$STOKER_ADMISSION_FILE`` in ``environ`` (the process environment when None).
        """
        env = os.environ if environ is None else environ
        b = spec.buffer
        settings = cls(
            capacity=b.capacity,
            group_size=b.group_size,
            max_staleness=b.max_staleness,
            batch_groups=spec.learner.batch_groups,
            sync=b.sync,
            failed_group_policy=b.failed_group_policy,
            sample_order=b.sample_order,
            group_timeout_seconds=b.group_timeout_seconds,
            admission_file=env.get(ADMISSION_FILE_ENV) or None,
        )
        return replace(settings, **overrides) if overrides else settings
