"""The gRPC channel options every Stoker client uses, so it comes back soon after its server does.

gRPC's default reconnect backoff grows to 120 s, and an RPC on a channel waiting out its backoff
fails at once: a client kept retrying for minutes against a buffer that had been back for 30 s.
Every client channel (buffer, weights, rollout, sandbox) takes these options instead:

* ``grpc.initial_reconnect_backoff_ms`` / ``grpc.max_reconnect_backoff_ms``: the first retry after
  ``RECONNECT_INITIAL_MS``, growing by gRPC's 1.6x (with +-20 % jitter) to at most
  ``RECONNECT_MAX_MS``, so a client reconnects within ``RECONNECT_BOUND_SECONDS`` of its server
  listening again, however long it was gone.
* ``grpc.min_reconnect_backoff_ms``: gRPC's name for the least time one connection attempt is given
  (default 20 s); a pod IP that went away drops SYNs, and the attempt must not outlast that.
* ``grpc.use_local_subchannel_pool``: gRPC shares a subchannel (and its backoff) between the
  channels of a process that name the same address; a fresh client gets a fresh connection.
"""

from __future__ import annotations

from collections.abc import Iterable

RECONNECT_INITIAL_MS = 250
RECONNECT_MAX_MS = 1000
CONNECT_TIMEOUT_MS = 5000
RECONNECT_JITTER = 0.2  # gRPC's own, fixed
# From a server listening again to the client's next connection attempt, at most.
RECONNECT_BOUND_SECONDS = RECONNECT_MAX_MS * (1 + RECONNECT_JITTER) / 1000

RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ("grpc.use_local_subchannel_pool", 1),
)


def channel_options(extra: Iterable[tuple[str, int | str]] = ()) -> list[tuple[str, int | str]]:
    """``RECONNECT_OPTIONS`` plus a client's own (message sizes, ...)."""
    return [*RECONNECT_OPTIONS, *extra]
