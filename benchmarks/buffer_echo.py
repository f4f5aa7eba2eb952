"""The echo servers ``buffer_throughput.py`` measures the buffer against: the gRPC transport
ceiling (``echo``), and the same plus a durable append of each Put (``echo-log``)."""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent import futures
from pathlib import Path


class DurableLog:
    """The least a durable server must do per Put: append its bytes to a file and flush before
    answering, with concurrent Puts sharing one ``fdatasync`` (group commit). Files of
    ``SEGMENT_BYTES``, preallocated as the buffer's log is, replace each other when full."""

    SEGMENT_BYTES = 256 << 20

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.write_lock = threading.Lock()
        self.sync_lock = threading.Lock()
        self.segment = 0
        self.fd = self._open(0)
        self.offset = 0
        self.written = 0  # bytes appended in all, over every segment
        self.synced = 0  # ...of which flushed
        self.retired: list[int] = []  # full files' descriptors, closed by the next flush (one may be flushing them)

    def _open(self, number: int) -> int:
        fd = os.open(self.directory / f"{number:06d}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(fd, 0, self.SEGMENT_BYTES)
        return fd

    def append(self, data: bytes) -> None:
        with self.write_lock:
            if self.offset + len(data) > self.SEGMENT_BYTES:
                os.fdatasync(self.fd)  # what the old file holds is durable before it is dropped
                self.retired.append(self.fd)
                (self.directory / f"{self.segment:06d}.log").unlink()
                self.segment += 1
                self.fd, self.offset = self._open(self.segment), 0
            os.pwrite(self.fd, data, self.offset)
            self.offset += len(data)
            self.written += len(data)
            mine = self.written
        with self.sync_lock:
            if self.synced >= mine:
                return  # another Put's flush covered this one
            with self.write_lock:
                fd, upto = self.fd, self.written
                retired, self.retired = self.retired, []
            os.fdatasync(fd)
            self.synced = upto
            for old in retired:
                os.close(old)


def run_echo_server(ready_file: Path, capacity: int, max_message_bytes: int, log_dir: Path | None = None) -> None:
    """The transport ceiling: Put bytes in, Sample bytes out, nothing else -- or, with ``log_dir``,
    only that and a durable append of each Put (``echo-log``)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from stoker.endpoints import write_ready_file
    from stoker.buffer.wire import encode_varint, split_put_request
    from stoker.v1 import buffer_pb2

    log = DurableLog(log_dir) if log_dir is not None else None
    cond = threading.Condition()
    queue: collections.deque[tuple[bytes, int]] = collections.deque()  # (PutRequest bytes, trajectories)
    held = [0]
    replies: dict[int, bytes] = {}

    def put(data: bytes, context: grpc.ServicerContext) -> bytes:
        # Walking the framing counts the trajectories, so the reply can say how many were taken.
        count = len(split_put_request(data)[1])
        if log is not None:
            log.append(data)
        with cond:
            # Full: wait a little rather than refuse at once, so few transfers are wasted.
            deadline = time.monotonic() + 0.2
            while held[0] + count > capacity and held[0] > 0:
                if not cond.wait(max(0.0, deadline - time.monotonic())):
                    context.set_trailing_metadata((("stoker-retry-after-ms", "10"),))
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "echo queue full")
            queue.append((data, count))
            held[0] += count
            cond.notify_all()
        if count not in replies:
            replies[count] = buffer_pb2.PutResponse(results=[buffer_pb2.PutResult()] * count, stored=count).SerializeToString()
        return replies[count]

    def sample(request: buffer_pb2.SampleRequest, context: grpc.ServicerContext) -> bytes:
        deadline = time.monotonic() + request.timeout_seconds
        with cond:
            while len(queue) < max(1, request.min_groups):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return b""
                cond.wait(remaining)
            taken = [queue.popleft() for _ in range(min(request.max_groups, len(queue)))]
            held[0] -= sum(count for _, count in taken)
            cond.notify_all()
        # A PutRequest {1: client_id, 2: trajectories} parses as a Group {1: group_id, 2: trajectories}.
        chunks = [b"\x0a\x04echo"]  # batch_id
        for blob, _ in taken:
            chunks += [b"\x12" + encode_varint(len(blob)), blob]
        return b"".join(chunks)

    def commit(request: buffer_pb2.CommitRequest, context: grpc.ServicerContext) -> buffer_pb2.CommitResponse:
        return buffer_pb2.CommitResponse()

    def identity(data: bytes) -> bytes:
        return data

    handler = grpc.method_handlers_generic_handler(
        "stoker.v1.Buffer",
        {
            "Put": grpc.unary_unary_rpc_method_handler(put, request_deserializer=identity, response_serializer=identity),
            "Sample": grpc.unary_unary_rpc_method_handler(
                sample, request_deserializer=buffer_pb2.SampleRequest.FromString, response_serializer=identity
            ),
            "Commit": grpc.unary_unary_rpc_method_handler(
                commit,
                request_deserializer=buffer_pb2.CommitRequest.FromString,
                response_serializer=buffer_pb2.CommitResponse.SerializeToString,
            ),
        },
    )
    options = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), handlers=[handler], options=options)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    health_servicer.set("stoker.v1.Buffer", health_pb2.HealthCheckResponse.SERVING)
    write_ready_file(ready_file, port)
    server.wait_for_termination()
