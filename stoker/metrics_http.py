"""A process's Prometheus endpoint on a TCP port or a unix socket, and never a crash.

A metrics endpoint is an observer: where it cannot listen (a host that refuses inet sockets, a
port taken) the process logs why and runs on without it.
"""

from __future__ import annotations

import logging
import socketserver
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, MetricsHandler, start_http_server

from stoker.endpoints import Address, AddressError, prepare_unix_socket

log = logging.getLogger(__name__)


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _UnixMetricsHandler(MetricsHandler):
    def address_string(self) -> str:  # a unix peer has no host to print
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        return


@dataclass
class MetricsEndpoint:
    """A serving endpoint: where it is, and how to stop it."""

    address: Address
    server: Any

    @property
    def port(self) -> int | None:
        return None if self.address.is_unix else self.address.port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(address: Address, registry: CollectorRegistry, *, where: str) -> MetricsEndpoint | None:
    """Serve ``registry`` at ``address`` (``where`` names the flag in messages); None, logged,
    where it cannot listen."""
    try:
        if address.path is not None:
            prepare_unix_socket(address, where=where)
            server: Any = _UnixHTTPServer(address.path, _UnixMetricsHandler.factory(registry))
            threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
            return MetricsEndpoint(address, server)
        server, _ = start_http_server(address.port, addr=address.host, registry=registry)
        return MetricsEndpoint(address.with_port(int(server.server_port)), server)
    except (OSError, AddressError) as exc:
        log.warning("%s %s: metrics endpoint off, cannot listen (%s)", where, address, exc)
        return None
