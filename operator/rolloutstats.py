"""Reading every rollout server's ``Stats`` over gRPC, each call bounded, all servers at once.

The operator observes every few seconds, so a server that does not answer costs one bounded call
per look, never a stalled timer; its address and why go into the status instead.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from stoker.channels import channel_options
from stoker.operator.rollout_control import RolloutReading, ServerStats
from stoker.v1 import rollout_pb2, rollout_pb2_grpc

MAX_PARALLEL_READS = 16


def stats_from_proto(address: str, stats: rollout_pb2.RolloutStats) -> ServerStats:
    return ServerStats(
        address=address,
        ready=bool(stats.ready),
        policy_version=int(stats.policy_version),
        tokens_per_second=float(stats.tokens_per_second),
        queue_depth=int(stats.queue_depth),
        running=int(stats.running),
        max_batch=int(stats.max_batch) or 1,
        batch_occupancy=float(stats.batch_occupancy),
        kv_cache_bytes_used=int(stats.kv_cache_bytes_used),
        kv_cache_bytes_total=int(stats.kv_cache_bytes_total),
        rejected_total=int(stats.rejected_total),
    )


class RolloutStatsReader:
    """One cached channel per server address; ``read_all`` reads them in parallel."""

    def __init__(self, timeout: float = 3.0):
        self.timeout = timeout
        self._stubs: dict[str, tuple[grpc.Channel, rollout_pb2_grpc.RolloutStub]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=MAX_PARALLEL_READS, thread_name_prefix="rollout-stats")

    def _stub(self, address: str) -> rollout_pb2_grpc.RolloutStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                channel = grpc.insecure_channel(address, options=channel_options())
                entry = (channel, rollout_pb2_grpc.RolloutStub(channel))
                self._stubs[address] = entry
        return entry[1]

    def read(self, address: str) -> ServerStats | str:
        """The server's Stats, or why it did not answer (``"UNAVAILABLE: ..."``)."""
        try:
            reply = self._stub(address).Stats(rollout_pb2.RolloutStatsRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            return f"{code.name if code else 'error'}: {details}"
        except ValueError as exc:  # grpc: "Cannot invoke RPC on closed channel" (forgotten meanwhile)
            return str(exc)
        return stats_from_proto(address, reply)

    def read_all(self, addresses: Sequence[str], *, rejected: int = 0) -> RolloutReading:
        results = list(self._pool.map(self.read, addresses))
        servers = tuple(r for r in results if isinstance(r, ServerStats))
        errors = tuple(f"{a}: {r}" for a, r in zip(addresses, results) if isinstance(r, str))
        return RolloutReading(servers=servers, errors=errors, rejected=rejected)

    def forget(self, addresses: Sequence[str]) -> None:
        """Close the channels of these servers (gone, or their job deleted)."""
        with self._lock:
            channels = [self._stubs.pop(a)[0] for a in addresses if a in self._stubs]
        for channel in channels:
            channel.close()

    def close(self) -> None:
        self.forget(list(self._stubs))
        self._pool.shutdown(wait=False)
