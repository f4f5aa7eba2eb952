"""The write-ahead log's on-disk format: segments of checksummed records, and reading them back.

A data directory holds segments ``000000000001.wal``, ``000000000002.wal``, ... Each starts with an
8-byte magic and holds records::

    u32 payload length | u32 crc32(type byte + payload) | u8 type | payload

(little-endian; zlib's CRC-32, computed with ISA-L's ``isal_zlib.crc32``: the same values at
~60 instead of ~7 GB/s). A clean segment ends in zeros (preallocated space not yet written).
Readers stop at the first record that is truncated or fails its checksum (a crash mid-write) and
skip the rest of that segment with a warning, unless the rest is all zeros (unused preallocated
space); later segments are still read. Padding records (type ``PAD``, zero payload) fill the gaps
that aligned direct writes leave; readers skip them, so a segment stays one unbroken run of records.
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from isal import isal_zlib

log = logging.getLogger("stoker.buffer.wal")

MAGIC = b"STKWAL1\n"
HEADER = struct.Struct("<IIB")
SEGMENT_RE = re.compile(r"^(\d{12})\.wal$")
PAD = 255  # record type of alignment padding; never returned to readers
ALIGN = 4096  # O_DIRECT offset, length and memory alignment (the usual logical block size or more)

Position = tuple[int, int]  # (segment number, byte offset): totally ordered


@dataclass
class Segment:
    number: int
    path: Path
    size: int = 0
    allocated: int = 0  # bytes preallocated (the active segment only)
    pins: int = 0  # live records the owner has not released
    pinned_bytes: int = 0


@dataclass
class ReplayRecord:
    segment: int
    kind: int
    payload: memoryview


@dataclass
class ReplayReport:
    segments: int = 0
    records: int = 0
    corrupt: list[str] = field(default_factory=list)  # one line per skipped tail
    clean_ends: dict[int, int] = field(default_factory=dict)  # segment -> end of its records, when the rest is zeros


# crc32 of the type byte alone, the starting value of each record's checksum
_KIND_CRC = [isal_zlib.crc32(bytes((kind,))) for kind in range(256)]


# crc32 releases the GIL for inputs over 5 KiB. For short records that costs more than it
# saves: every release is a handoff to another server thread (and back) on a busy machine. Short
# records are checksummed in 4 KiB pieces, which keeps the GIL; long ones in one call, which frees it.
_PIECE = 4096
_PIECEWISE_BELOW = 64 * 1024


def checksum(kind: int, payload: bytes | memoryview) -> int:
    crc = _KIND_CRC[kind]
    size = len(payload)
    if size > _PIECEWISE_BELOW or size <= _PIECE:
        return isal_zlib.crc32(payload, crc)
    view = memoryview(payload)
    for start in range(0, size, _PIECE):
        crc = isal_zlib.crc32(view[start : start + _PIECE], crc)
    return crc


def record_chunks(kind: int, payload: bytes | memoryview) -> list[bytes | memoryview]:
    crc = checksum(kind, payload)
    return [HEADER.pack(len(payload), crc, kind), payload]


def padding_after(offset: int) -> int:
    """Bytes of padding from ``offset`` to the next aligned offset: 0, or at least a record header."""
    pad = -offset % ALIGN
    return pad + ALIGN if 0 < pad < HEADER.size else pad


def padding_record(size: int) -> bytes:
    """A ``PAD`` record exactly ``size`` bytes long (header included)."""
    zeros = bytes(size - HEADER.size)
    return HEADER.pack(len(zeros), checksum(PAD, zeros), PAD) + zeros


def _all_zero(view: memoryview) -> bool:
    return bytes(view).count(0) == len(view)


def segment_name(number: int) -> str:
    return f"{number:012d}.wal"


def read_records(data: bytes, source: str, max_record: int) -> tuple[list[tuple[int, memoryview]], str | None]:
    """Every intact record of one segment's bytes, and a warning if a bad tail was skipped."""
    records, warning, _ = read_segment(data, source, max_record)
    return records, warning


def read_segment(data: bytes, source: str, max_record: int) -> tuple[list[tuple[int, memoryview]], str | None, int | None]:
    """``read_records`` plus where the records end when only zeros follow (None after a bad tail)."""
    view = memoryview(data)
    if view[: len(MAGIC)] != MAGIC:
        if len(data) < len(MAGIC) and MAGIC.startswith(bytes(view)):
            return [], f"{source}: truncated segment header ({len(data)} bytes); segment skipped", None
        return [], f"{source}: not a Stoker log segment (bad magic); segment skipped", None
    records: list[tuple[int, memoryview]] = []
    pos, end = len(MAGIC), len(data)
    while pos < end:
        if pos + HEADER.size > end:
            return records, f"{source}: truncated record header at offset {pos}; {end - pos} trailing bytes skipped", None
        length, crc, kind = HEADER.unpack_from(view, pos)
        if length == 0 and crc == 0 and kind == 0 and _all_zero(view[pos:]):
            return records, None, pos  # unused preallocated space: a clean end
        start = pos + HEADER.size
        if length > max_record:
            return records, f"{source}: implausible record length {length} at offset {pos}; {end - pos} bytes skipped", None
        if start + length > end:
            return records, f"{source}: truncated record at offset {pos}; {end - pos} trailing bytes skipped", None
        payload = view[start : start + length]
        if checksum(kind, payload) != crc:
            return records, f"{source}: checksum mismatch at offset {pos}; {end - pos} bytes skipped", None
        if kind != PAD:
            records.append((kind, payload))
        pos = start + length
    return records, None, pos


def replay_segments(directory: Path, max_record: int) -> tuple[dict[int, Segment], Iterator[ReplayRecord], ReplayReport]:
    """The segments in ``directory`` and every intact record of them, oldest first (read lazily;
    ``report`` is complete once the records are)."""
    directory.mkdir(parents=True, exist_ok=True)
    numbers = sorted(int(m.group(1)) for p in directory.iterdir() if (m := SEGMENT_RE.match(p.name)))
    report = ReplayReport(segments=len(numbers))
    segments: dict[int, Segment] = {}
    for number in numbers:
        path = directory / segment_name(number)
        segments[number] = Segment(number, path, size=path.stat().st_size)

    def records() -> Iterator[ReplayRecord]:
        for number in numbers:
            segment = segments[number]
            data = segment.path.read_bytes()
            found, warning, clean_end = read_segment(data, segment.path.name, max_record)
            if clean_end is not None:
                report.clean_ends[number] = clean_end
            if warning:
                log.warning("write-ahead log: %s", warning)
                report.corrupt.append(warning)
            for kind, payload in found:
                report.records += 1
                yield ReplayRecord(number, kind, payload)

    return segments, records(), report
