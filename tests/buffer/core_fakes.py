"""What the buffer's core tests share: a clock they move by hand, a core opened on a folder, a Put
of whole episodes and the ids of a sampled batch."""

from __future__ import annotations

from pathlib import Path

from stoker.buffer.core import BufferCore
from stoker.buffer.settings import BufferSettings
from stoker.buffer.wire import encode_trajectory
from stoker.trajectory import Episode, from_proto
from stoker.v1 import trajectory_pb2


class FakeClock:
    """``BufferCore``'s clock, moved by setting ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def open_core(path: Path, settings: BufferSettings, clock: FakeClock | None = None) -> BufferCore:
    core = BufferCore(settings, path, clock=clock or FakeClock())
    core.open()
    return core


def put(core: BufferCore, episodes: list[Episode]) -> list[tuple[int, str, str]]:
    return core.put([encode_trajectory(e) for e in episodes]).results


def sampled_ids(core: BufferCore, max_groups: int = 100) -> tuple[str, list[list[str]]]:
    batch = core.sample(max_groups, 1, 0)
    assert batch is not None
    return batch.batch_id, [[from_proto(trajectory_pb2.Trajectory.FromString(r)).episode_id for r in raws] for _, raws, _ in batch.groups]
