"""The write-ahead log: records come back in order; damaged tails are skipped, not fatal; concurrent
writers share flushes."""

from __future__ import annotations

import errno
import logging
import threading
import zlib
from pathlib import Path

import pytest

import stoker.buffer.wal as wal_module
import stoker.buffer.wal_files as wal_files
from stoker.buffer.wal import Wal
from stoker.buffer.wal_direct import DIRECT_MIN
from stoker.buffer.wal_files import WalError, WalFull
from stoker.buffer.wal_format import HEADER, MAGIC, checksum


def write_segments(directory: Path, payloads: list[bytes], segment_bytes: int = 1 << 20) -> Wal:
    wal = Wal(directory, fsync=True, segment_bytes=segment_bytes)
    records, _ = wal.replay()
    assert list(records) == []
    wal.start()
    for payload in payloads:
        wal.sync(wal.append(1, [payload]))
    return wal


def replayed(directory: Path) -> tuple[list[bytes], list[str]]:
    wal = Wal(directory)
    records, report = wal.replay()
    return [bytes(r.payload) for r in records], report.corrupt


def test_records_replay_in_order_across_segments(tmp_path: Path) -> None:
    wal = write_segments(tmp_path, [b"a", b"bb"])
    wal.rotate((9, b"checkpoint"))
    wal.sync(wal.append(1, [b"ccc", b"dddd"]))
    wal.close()
    payloads, corrupt = replayed(tmp_path)
    assert payloads == [b"a", b"bb", b"checkpoint", b"ccc", b"dddd"]
    assert corrupt == []
    # a closed segment is cut back to its used length (preallocated space given back)
    first = sorted(tmp_path.glob("*.wal"))[0]
    assert first.stat().st_size == len(MAGIC) + 2 * HEADER.size + 3


def test_preallocated_zeros_after_a_crash_are_a_clean_end(tmp_path: Path) -> None:
    wal = write_segments(tmp_path, [b"one", b"two"])
    # no close(): like kill -9, the file keeps its preallocated zero tail
    assert sorted(tmp_path.glob("*.wal"))[0].stat().st_size >= 1 << 20
    payloads, corrupt = replayed(tmp_path)
    assert payloads == [b"one", b"two"]
    assert corrupt == []
    del wal


def test_a_small_log_holds_little_disk_even_when_not_closed(tmp_path: Path) -> None:
    wal = write_segments(tmp_path, [b"x" * 1000] * 3, segment_bytes=256 << 20)
    # no close(), like kill -9: what stays on disk is the first preallocation, not the whole segment
    segment = sorted(tmp_path.glob("*.wal"))[0]
    assert segment.stat().st_size == wal_module.PREALLOCATE_FIRST
    del wal


def test_preallocation_doubles_ahead_of_buffered_and_direct_appends(tmp_path: Path) -> None:
    small = [bytes([i]) * 100_000 for i in range(12)]  # 1.2 MB through the page cache
    large = [bytes([100 + i]) * (DIRECT_MIN + 5) for i in range(6)]  # then 1.6 MB direct
    wal = write_segments(tmp_path, small + large, segment_bytes=256 << 20)
    assert wal.direct.appends == len(large)
    # 2.8 MB of records: preallocated 1, then 2, then 4 MiB, ahead of the direct writes too
    assert sorted(tmp_path.glob("*.wal"))[0].stat().st_size == 4 << 20
    assert replayed(tmp_path) == (small + large, [])
    del wal


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncate-mid-payload", "truncated record"),
        ("truncate-mid-header", "truncated record header"),
        ("flip-payload-byte", "checksum mismatch"),
        ("garbage-length", "implausible record length"),
    ],
)
def test_damaged_tail_is_skipped_with_a_warning(
    tmp_path: Path, damage: str, expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    wal = write_segments(tmp_path, [b"keep-1", b"keep-2", b"lost-3" * 10])
    wal.close()
    path = sorted(tmp_path.glob("*.wal"))[0]
    data = bytearray(path.read_bytes())
    last = len(data) - (HEADER.size + 60)
    if damage == "truncate-mid-payload":
        data = data[: last + HEADER.size + 7]
    elif damage == "truncate-mid-header":
        data = data[: last + 4]
    elif damage == "flip-payload-byte":
        data[last + HEADER.size + 3] ^= 0xFF
    else:
        data[last : last + 4] = (0x7FFFFFFF).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="stoker.buffer.wal"):
        payloads, corrupt = replayed(tmp_path)
    assert payloads == [b"keep-1", b"keep-2"]
    assert len(corrupt) == 1 and expected in corrupt[0]
    assert expected in caplog.text


def test_damage_in_one_segment_does_not_hide_later_segments(tmp_path: Path) -> None:
    wal = write_segments(tmp_path, [b"a1", b"a2"])
    wal.rotate()
    wal.sync(wal.append(1, [b"b1"]))
    wal.close()
    first = sorted(tmp_path.glob("*.wal"))[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF  # damages a2
    first.write_bytes(bytes(data))
    payloads, corrupt = replayed(tmp_path)
    assert payloads == [b"a1", b"b1"]
    assert len(corrupt) == 1


def test_a_file_that_is_not_a_segment_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "000000000001.wal").write_bytes(b"hello world, not a log")
    payloads, corrupt = replayed(tmp_path)
    assert payloads == [] and "bad magic" in corrupt[0]


def test_concurrent_writers_all_become_durable(tmp_path: Path) -> None:
    wal = Wal(tmp_path, fsync=True)
    wal.replay()
    wal.start()
    threads, per_thread = 8, 25
    start = threading.Barrier(threads)

    def writer(index: int) -> None:
        start.wait()
        for i in range(per_thread):
            wal.sync(wal.append(1, [f"{index}-{i}".encode()]))

    workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wal.close()
    payloads, _ = replayed(tmp_path)
    assert sorted(payloads) == sorted(f"{i}-{j}".encode() for i in range(threads) for j in range(per_thread))


def test_one_flush_covers_every_append_made_while_another_flush_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = wal_module.os.fdatasync
    entered, release = threading.Event(), threading.Event()
    flushes: list[int] = []

    def slow_disk(fd: int) -> None:
        flushes.append(fd)
        if len(flushes) == 1:
            entered.set()
            assert release.wait(10)
        real(fd)

    wal = Wal(tmp_path, fsync=True)
    wal.replay()
    wal.start()
    monkeypatch.setattr(wal_module.os, "fdatasync", slow_disk)
    first = threading.Thread(target=lambda: wal.sync(wal.append(1, [b"first"])))
    first.start()
    assert entered.wait(10)  # the first flush is in progress...
    positions = [wal.append(1, [f"later-{i}".encode()]) for i in range(3)]  # ...while three more arrive
    release.set()
    first.join()
    for position in positions:
        wal.sync(position)
    assert len(flushes) == 2  # the three later appends shared one flush


def test_pins_keep_count_of_live_records(tmp_path: Path) -> None:
    wal = Wal(tmp_path)
    wal.replay()
    wal.start()
    segment, _ = wal.append(1, [b"x", b"yy"], pin=True)
    assert wal.segments[segment].pins == 2
    wal.unpin(segment, 2, 2 * HEADER.size + 3)
    assert wal.segments[segment].pins == 0 and wal.segments[segment].pinned_bytes == 0
    wal.close()


# ---------------------------------------------------------------- direct (O_DIRECT) appends

BIG = DIRECT_MIN + 1000  # one record this size makes an append go direct


def open_wal(directory: Path) -> Wal:
    wal = Wal(directory, fsync=True)
    wal.replay()
    wal.start()
    if wal.direct.fd < 0:
        pytest.skip("this file system refuses O_DIRECT")
    return wal


def blob(tag: int, size: int) -> bytes:
    return bytes([tag]) * size


def test_large_appends_go_direct_and_replay_in_order_with_small_ones(tmp_path: Path) -> None:
    wal = open_wal(tmp_path)
    payloads = [b"small-1", blob(1, BIG), b"small-2", blob(2, 3 * BIG), b"small-3", blob(3, BIG)]
    for payload in payloads:
        wal.sync(wal.append(1, [payload]))
    assert wal.direct.appends == 3
    assert replayed(tmp_path) == (payloads, [])  # after a crash: the preallocated tail is still there
    wal.close()
    assert replayed(tmp_path) == (payloads, [])


def start_direct_write_held_at_the_disk(
    wal: Wal, payload: bytes, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Thread, threading.Event]:
    """Append ``payload`` (large: direct) in a thread whose write waits at the disk until the
    returned event is set; returns once the write is under way."""
    writing, release = threading.Event(), threading.Event()
    real = wal_files.write_aligned

    def slow_disk(fd: int, view: memoryview, offset: int) -> None:
        writing.set()
        assert release.wait(10)
        real(fd, view, offset)

    monkeypatch.setattr(wal_files, "write_aligned", slow_disk)
    big = threading.Thread(target=lambda: wal.sync(wal.append(1, [payload])))
    big.start()
    assert writing.wait(10)
    return big, release


def test_an_append_behind_a_direct_write_under_way_waits_for_it_to_be_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal = open_wal(tmp_path)
    big, release = start_direct_write_held_at_the_disk(wal, blob(7, BIG), monkeypatch)
    position = wal.append(1, [b"after"])  # buffered, behind the stretch the direct write claimed
    synced = threading.Event()
    waiter = threading.Thread(target=lambda: (wal.sync(position), synced.set()))
    waiter.start()
    assert not synced.wait(0.3), "acknowledged while an earlier record was not written yet"
    release.set()
    big.join(10)
    waiter.join(10)
    assert synced.is_set()
    wal.close()
    assert replayed(tmp_path) == ([blob(7, BIG), b"after"], [])


def test_rotation_waits_for_a_direct_write_under_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wal = open_wal(tmp_path)
    big, release = start_direct_write_held_at_the_disk(wal, blob(5, BIG), monkeypatch)
    rotated = threading.Event()
    rotator = threading.Thread(target=lambda: (wal.rotate(), rotated.set()))
    rotator.start()
    assert not rotated.wait(0.3), "the segment was closed under a write"
    release.set()
    big.join(10)
    rotator.join(10)
    wal.sync(wal.append(1, [b"next segment"]))
    wal.close()
    assert replayed(tmp_path) == ([blob(5, BIG), b"next segment"], [])


def test_a_failed_direct_write_leaves_the_records_after_it_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal = open_wal(tmp_path)
    wal.sync(wal.append(1, [b"before"]))

    def broken_disk(fd: int, view: memoryview, offset: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(wal_files, "write_aligned", broken_disk)
    with pytest.raises(WalError, match="append failed"):
        wal.append(1, [blob(9, BIG)])
    wal.sync(wal.append(1, [b"after"]))
    assert replayed(tmp_path) == ([b"before", b"after"], [])  # no hole: the failed stretch is padding


def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal = open_wal(tmp_path)
    calls: list[int] = []

    def refuses(fd: int, view: memoryview, offset: int) -> None:
        calls.append(offset)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(wal_files, "write_aligned", refuses)
    for tag in (1, 2):
        wal.sync(wal.append(1, [blob(tag, BIG)]))
    assert len(calls) == 1 and wal.direct.appends == 0  # tried once, then buffered for good
    wal.close()
    assert replayed(tmp_path) == ([blob(1, BIG), blob(2, BIG)], [])


def test_a_failed_direct_write_pins_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wal = open_wal(tmp_path)

    def broken_disk(fd: int, view: memoryview, offset: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    segment, _ = wal.append(1, [b"live"], pin=True)
    monkeypatch.setattr(wal_files, "write_aligned", broken_disk)
    with pytest.raises(WalError):
        wal.append(1, [blob(4, BIG)], pin=True)
    assert wal.segments[segment].pins == 1  # the segment can still be released by its live record
    monkeypatch.undo()
    position = wal.append(1, [blob(4, BIG)], pin=True)
    wal.sync(position)
    assert wal.segments[segment].pins == 2 and wal.direct.appends == 1
    wal.close()


@pytest.mark.parametrize("size", [0, 100, 4096, 5000, 70_000, BIG])
def test_checksums_are_zlib_crc32_so_logs_of_earlier_versions_still_replay(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert checksum(3, payload) == zlib.crc32(bytes([3]) + payload)


def test_concurrent_direct_and_buffered_appends_across_rotations_all_replay_once(tmp_path: Path) -> None:
    wal = open_wal(tmp_path)
    threads, per_thread = 4, 12
    start = threading.Barrier(threads + 1)

    def payload(index: int, i: int) -> bytes:
        tag = f"{index}-{i}|".encode()
        return tag + bytes(BIG if i % 2 else 50)  # every other append goes direct

    def writer(index: int) -> None:
        start.wait()
        for i in range(per_thread):
            wal.sync(wal.append(1, [payload(index, i)]))

    workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    for _ in range(3):
        wal.rotate()  # while appends, direct and buffered, are under way
    for worker in workers:
        worker.join()
    wal.close()
    payloads, corrupt = replayed(tmp_path)
    assert corrupt == [] and wal.direct.appends > 0
    tags = [p.split(b"|", 1)[0].decode() for p in payloads]
    assert sorted(tags) == sorted(f"{i}-{j}" for i in range(threads) for j in range(per_thread))
    for index in range(threads):  # each writer's records in the order it wrote them
        mine = [t for t in tags if t.startswith(f"{index}-")]
        assert mine == [f"{index}-{j}" for j in range(per_thread)]


@pytest.mark.parametrize("fsync", [True, False], ids=["direct", "buffered"])
def test_a_failed_preallocation_is_not_booked_and_the_log_stays_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool) -> None:
    # Issue 25, defect 2: an append that finds no space must not leave the log refusing everything.
    size = 1536 << 10  # past the first preallocation (1 MiB); direct when fsync is on
    wal = Wal(tmp_path, fsync=fsync, segment_bytes=4 << 20, reserve=64 << 10)
    list(wal.replay()[0])
    wal.start()
    segment = wal.segments[wal.active_segment]
    allocated, size_before = segment.allocated, segment.size
    real_fallocate = wal_module.os.posix_fallocate

    def full_volume(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wal_module.os, "posix_fallocate", full_volume)
    big = bytes(range(256)) * (size // 256)
    with pytest.raises(WalFull):
        wal.append(1, [big])
    assert (segment.allocated, segment.size) == (allocated, size_before) and wal.broken is None and wal.full
    wal.sync(wal.append(2, [b"commit"], reserved=True))  # consumption records still fit in the reserve
    monkeypatch.setattr(wal_module.os, "posix_fallocate", real_fallocate)
    wal.sync(wal.append(1, [big]))
    assert wal.full is None
    wal.close()
    records, _ = replayed(tmp_path)
    assert records == [b"commit", big]
