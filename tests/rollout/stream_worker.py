"""A stream server over a shared directory's shard files, for ``test_weight_stream.py``.

    python stream_worker.py OUT DIRECTORY STALL_AFTER

Serves ``DIRECTORY`` (``sendfile`` of the committed shard files) on a free port, written to
``OUT/stream.port``. Once it has served ``STALL_AFTER`` bytes it sends only the first half of
each further request, writes ``OUT/stalled`` and sends nothing more (the test then kills it
mid-transfer).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


class HalfThenStall:
    """A shard's bytes whose slices are cut in half (what a server dying mid-send has sent)."""

    def __init__(self, data: bytes, marker: Path):
        self.data, self.marker = memoryview(data), marker

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, where: slice) -> memoryview:
        part = self.data[where]
        self.marker.touch()
        return part[: len(part) // 2]


def main() -> int:
    out, directory, stall_after = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    from stoker.weights.shard_stream import StreamServer, directory_lookup
    from stoker.weights.shards import ShardDirectory

    files = directory_lookup(ShardDirectory(directory))
    server: StreamServer

    def lookup(version: int, process: int, key: str) -> object:
        path = files(version, process, key)
        if path is None or server.served_bytes < stall_after:
            return path
        return HalfThenStall(Path(path).read_bytes(), out / "stalled")  # type: ignore[arg-type]

    server = StreamServer("127.0.0.1:0", lookup)  # type: ignore[arg-type]
    (out / "stream.port.tmp").write_text(str(server.port))
    (out / "stream.port.tmp").rename(out / "stream.port")
    threading.Event().wait(300)  # until the test kills it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
