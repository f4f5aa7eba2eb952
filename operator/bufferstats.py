"""Reading a job's buffer Stats, and applying its live settings (Configure), over gRPC with its
bearer token (``stoker.buffer.client``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc

from stoker.buffer.client import AuthError, BufferClient, BufferUnavailableError, RetryPolicy
from stoker.operator.observe import StatsSnapshot, snapshot_from_proto


class StatsUnavailable(Exception):
    """The buffer did not answer Stats; the message says how it failed."""

    def __init__(self, message: str, *, auth: bool = False):
        super().__init__(message)
        self.auth = auth
        """The buffer refused the token (it may have been rotated: read it again)."""


class StatsReader:
    """One cached client per (buffer address, token); a call never retries past ``timeout``.

    The operator observes every few seconds anyway, so a slow or absent buffer costs one bounded
    call per tick rather than the client's long default retry deadline.
    """

    def __init__(self, timeout: float = 5.0):
        self.timeout = timeout
        self._clients: dict[tuple[str, str | None], BufferClient] = {}
        self._lock = threading.Lock()

    def _client(self, address: str, token: str | None) -> BufferClient:
        with self._lock:
            client = self._clients.get((address, token))
            if client is None:
                retry = RetryPolicy(initial=0.05, maximum=0.5, deadline=self.timeout)
                client = BufferClient(address, token=token, retry=retry, timeout=self.timeout)
                self._clients[(address, token)] = client
        return client

    def read(self, address: str, token: str | None) -> StatsSnapshot:
        return snapshot_from_proto(self._call(f"Stats from {address}", address, token, lambda client: client.stats()))

    def configure(self, address: str, token: str | None, changes: dict[str, int]) -> None:
        """``BufferClient.configure(**changes)``; ``StatsUnavailable`` when the call fails."""
        self._call(f"Configure at {address}", address, token, lambda client: client.configure(**changes))

    def _call(self, what: str, address: str, token: str | None, call: Callable[[BufferClient], Any]) -> Any:
        try:
            return call(self._client(address, token))
        except AuthError as exc:
            raise StatsUnavailable(f"{what}: the buffer refused the token: {exc}", auth=True) from None
        except BufferUnavailableError as exc:
            raise StatsUnavailable(str(exc)) from None
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise StatsUnavailable(f"{what}: {code.name if code else 'error'}: {details}") from None
        except ValueError as exc:  # grpc: "Cannot invoke RPC on closed channel" (forgotten meanwhile)
            raise StatsUnavailable(f"{what}: {exc}") from None

    def forget(self, address: str) -> None:
        with self._lock:
            stale = [key for key in self._clients if key[0] == address]
            clients = [self._clients.pop(key) for key in stale]
        for client in clients:
            client.close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
