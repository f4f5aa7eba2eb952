"""Endpoint addresses: every server and client takes ``unix:///path`` or ``host:port``.

A unix-domain socket is how processes on one host talk where no inet socket may be made (a TPU VM
host that refuses ``socket(AF_INET)``), and needs no free port, so local runs cannot race for one.
gRPC speaks both forms natively; the raw shard stream (``stoker.weights.shard_stream``) opens the
matching socket family itself (``listen``, ``connect``).
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UNIX_SCHEME = "unix:"
# sun_path holds 108 bytes with the terminating NUL (Linux); gRPC refuses longer paths too.
MAX_UNIX_PATH_BYTES = 107


class AddressError(ValueError):
    """An address that cannot be used; the message names the flag or field it came from."""


@dataclass(frozen=True)
class Address:
    """A parsed endpoint: a unix socket ``path``, or ``host`` and ``port`` (0: any free port)."""

    path: str | None = None
    host: str = ""
    port: int = 0

    @property
    def is_unix(self) -> bool:
        return self.path is not None

    @property
    def target(self) -> str:
        """The form gRPC takes for a channel or a listening port (and what ``parse`` reads back)."""
        if self.path is not None:
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def with_port(self, port: int) -> Address:
        """This address with the port a server actually bound (``port`` 0 asks for any)."""
        return self if self.path is not None else Address(host=self.host, port=port)

    def __str__(self) -> str:
        return self.target


def parse(text: str, *, where: str) -> Address:
    """``text`` as an address; ``where`` (a flag, ``--buffer``, or a spec field) names it in errors.

    Accepted: ``unix:///absolute/path`` (or ``unix:relative/path``, made absolute here) and
    ``host:port`` (``[v6-host]:port`` for IPv6); the port may be 0 for a server that picks one.
    """
    text = text.strip()
    if text.startswith(UNIX_SCHEME):
        raw = text[len(UNIX_SCHEME):]
        raw = raw[2:] if raw.startswith("//") else raw  # unix:///abs -> /abs; unix:rel -> rel
        if not raw:
            raise AddressError(f"{where} {text}: expected unix:///PATH with a socket path")
        path = os.path.abspath(os.path.expanduser(raw))
        if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            raise AddressError(
                f"{where} {text}: a unix socket path holds at most {MAX_UNIX_PATH_BYTES} bytes, this one "
                f"{len(os.fsencode(path))}; choose a shorter directory"
            )
        return Address(path=path)
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise AddressError(f"{where} {text}: expected HOST:PORT (port 0-65535) or unix:///PATH")
    return Address(host=host, port=int(port_text))


def prepare_unix_socket(address: Address, *, where: str) -> None:
    """Ready ``address``'s path for a server to bind: its folder exists, and a socket file left by
    a process that died (nothing accepts on it) is removed; a live one is an error, never stolen."""
    if address.path is None:
        return
    path = Path(address.path)
    if not path.parent.is_dir():
        raise AddressError(f"{where} {address}: folder {path.parent} does not exist")
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise AddressError(f"{where} {address}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # stale: its server is gone
            return
    raise AddressError(f"{where} {address}: another process is serving on this socket")


def socket_directory(run_dir: Path) -> Path:
    """Where a local run's sockets live: ``run_dir/sockets`` when its paths fit a unix socket's
    limit, else a private folder under the system's temporary directory (mode 0700)."""
    preferred = run_dir / "sockets"
    longest = preferred / "rollout-000.sock"  # the longest name a run gives a socket
    if len(os.fsencode(str(longest.resolve()))) <= MAX_UNIX_PATH_BYTES:
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred
    return Path(tempfile.mkdtemp(prefix="stoker-"))


def listen(address: Address, *, where: str, backlog: int = 64) -> socket.socket:
    """A listening stream socket at ``address`` (the raw shard stream's server side)."""
    if address.path is not None:
        prepare_unix_socket(address, where=where)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(address.path)
        except OSError:
            server.close()
            raise
    else:
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((address.host, address.port))
        except OSError:
            server.close()
            raise
    server.listen(backlog)
    return server


def bound(server: socket.socket, address: Address) -> Address:
    """``address`` with the port ``server`` really bound (for ``host:0``)."""
    return address if address.is_unix else address.with_port(int(server.getsockname()[1]))


def connect(address: Address, *, timeout: float) -> socket.socket:
    """A connected stream socket to ``address`` (the raw shard stream's reader side)."""
    if address.path is not None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(timeout)
        try:
            conn.connect(address.path)
        except OSError:
            conn.close()
            raise
        return conn
    return socket.create_connection((address.host, address.port), timeout=timeout)


def parse_listen(text: str, *, where: str, default_host: str) -> Address:
    """A server's listening address from a flag: a bare ``PORT`` (bound on ``default_host``, as the
    flag always took), ``HOST:PORT`` or ``unix:///PATH``."""
    text = str(text).strip()
    if text.isdigit():
        if int(text) > 65535:
            raise AddressError(f"{where} {text}: expected a port 0-65535, HOST:PORT or unix:///PATH")
        return Address(host=default_host, port=int(text))
    return parse(text, where=where)


def write_ready_file(path: str | Path, address: Address | int) -> None:
    """Announce a serving server: its bound port for TCP (what readers always got), its
    ``unix://`` target for a socket. Written atomically: readers never see half a file."""
    target = Path(path)
    text = str(address) if isinstance(address, int) else (address.target if address.is_unix else str(address.port))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{text}\n")
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def ready_address(content: str, *, host: str = "127.0.0.1") -> str:
    """The address a client dials from a ready file's ``content`` (``write_ready_file``)."""
    return content if content.startswith(UNIX_SCHEME) else f"{host}:{int(content)}"


def add_grpc_port(server: Any, address: Address, *, where: str, credentials: Any = None) -> Address:
    """Bind a gRPC ``server`` (sync or aio) to ``address``; the address clients dial, with the
    port it really bound (a unix socket has none: gRPC answers 1 for it)."""
    prepare_unix_socket(address, where=where)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address.target)
        else:
            bound = server.add_secure_port(address.target, credentials)
    except RuntimeError as exc:  # some gRPC versions raise where others answer 0
        raise OSError(f"{where}: cannot bind {address} ({exc})") from None
    if bound == 0:
        raise OSError(f"{where}: cannot bind {address}")
    return address.with_port(0 if address.is_unix else int(bound))
