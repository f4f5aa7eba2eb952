"""The buffer's disk-full state reaches the RLJob as ``BufferReady=False`` with reason ``DiskFull``."""

from __future__ import annotations

from stoker.operator.jobstatus import disk_full_condition
from stoker.operator.observe import StatsSnapshot, snapshot_from_proto
from stoker.v1 import buffer_pb2


def test_a_full_log_volume_makes_the_buffer_not_ready_with_reason_disk_full() -> None:
    snapshot = snapshot_from_proto(buffer_pb2.BufferStats(disk_full=True, disk_free_bytes=4096, fill=0.1))
    condition = disk_full_condition(snapshot)
    assert condition is not None
    assert (condition.type, condition.status, condition.reason) == ("BufferReady", "False", "DiskFull")
    assert "4096 bytes free" in condition.message


def test_a_buffer_with_room_has_no_disk_full_condition() -> None:
    assert disk_full_condition(snapshot_from_proto(buffer_pb2.BufferStats(disk_free_bytes=1 << 30))) is None
    assert disk_full_condition(StatsSnapshot()) is None
