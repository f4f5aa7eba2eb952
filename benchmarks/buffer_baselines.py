"""The baselines ``buffer_throughput.py`` sets beside each size: what the disk gives one writer
(append + fdatasync), and the CPU the buffer's own logic costs per trajectory without gRPC."""

from __future__ import annotations

import argparse
import mmap
import os
import time
from pathlib import Path

import numpy as np

from buffer_load import trajectory_body


def disk_baseline(directory: Path, batch_bytes: int, seconds: float) -> dict[str, float]:
    """What the log's disk gives one writer: append one Put's worth, fdatasync, repeat -- the way the
    log writes that size (through the page cache, or copied to an aligned buffer and written with
    O_DIRECT from ``DIRECT_MIN`` up)."""
    from stoker.buffer.wal_direct import DIRECT_MIN
    from stoker.buffer.wal_format import ALIGN

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "disk-baseline"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    direct = batch_bytes >= DIRECT_MIN
    stride = -(-batch_bytes // ALIGN) * ALIGN if direct else batch_bytes
    write_fd = os.open(path, os.O_WRONLY | os.O_DIRECT) if direct else fd
    staging = mmap.mmap(-1, stride)
    payload = os.urandom(batch_bytes)
    latencies: list[float] = []
    offset = 0
    try:
        os.posix_fallocate(fd, 0, 1 << 30)
        end = time.monotonic() + seconds
        cpu_before = time.thread_time()  # user + kernel time of this thread: the write and the flush
        while time.monotonic() < end and offset + stride < 1 << 30:
            began = time.perf_counter()  # a direct write waits for the device itself: time both parts
            if direct:
                staging[:batch_bytes] = payload
                os.pwrite(write_fd, staging, offset)
            else:
                os.pwrite(fd, payload, offset)
            offset += stride
            os.fdatasync(fd)
            latencies.append(time.perf_counter() - began)
        cpu = time.thread_time() - cpu_before
    finally:
        if direct:
            os.close(write_fd)
        os.close(fd)
        staging.close()
        path.unlink()
    total = sum(latencies) or 1e-9
    return {
        "append_p50_ms": float(np.percentile(latencies, 50) * 1e3),  # write + fdatasync
        "append_p99_ms": float(np.percentile(latencies, 99) * 1e3),
        "durable_mb_per_s": offset / 1e6 / total,
        "cpu_us_per_append": cpu / max(len(latencies), 1) * 1e6,
        "direct": float(direct),
    }


def logic_baseline(directory: Path, tokens: int, args: argparse.Namespace, seconds: float) -> float:
    """CPU microseconds per trajectory of the buffer's own work, in this one thread with no gRPC and
    no flush: split each Put request, validate, admit, append to the log (as the server writes it,
    direct from ``DIRECT_MIN`` up), store, then Sample, encode the response and Commit every
    ``--sample-groups`` Puts -- the floor under what the buffer server spends beyond the echo,
    whatever its threads or transport."""
    from unittest import mock

    import stoker.buffer.wal as wal_module
    from stoker.buffer.core import BufferCore
    from stoker.buffer.settings import BufferSettings
    from stoker.buffer.wire import encode_put_request, encode_sample_response, split_put_request
    from stoker.v1 import trajectory_pb2

    body = trajectory_body(tokens, 0)
    # The server's durable settings (so large appends go direct), minus the flush itself, which the
    # "disk" line measures.
    settings = BufferSettings(capacity=1 << 20, group_size=args.batch, max_staleness=1000, sync="batch")
    core = BufferCore(settings, directory)
    core.open()
    stored = 0
    try:
        with mock.patch.object(wal_module.os, "fdatasync", lambda fd: None):
            end = time.monotonic() + seconds
            cpu = 0.0
            while time.monotonic() < end:
                requests = []
                for index in range(args.sample_groups):  # encoded outside the measured CPU, as a client would
                    group = f"g{stored + index * args.batch}"
                    items = [
                        trajectory_pb2.Trajectory(episode_id=f"{group}e{k}", group_id=group, group_size=args.batch).SerializeToString() + body
                        for k in range(args.batch)
                    ]
                    requests.append(encode_put_request("logic", items))
                began = time.thread_time()
                for request in requests:
                    client_id, raws = split_put_request(request)
                    stored += core.put(raws, client_id).stored
                batch = core.sample(args.sample_groups, 1, 0)
                assert batch is not None
                encode_sample_response(batch.batch_id, batch.groups, batch.policy_version)
                core.commit(batch.batch_id)
                cpu += time.thread_time() - began
    finally:
        core.close()
    return cpu / max(stored, 1) * 1e6
