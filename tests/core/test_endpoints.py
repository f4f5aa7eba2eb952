"""Endpoint addresses: unix sockets and host:port, parsed once, with errors that name the flag."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from stoker.endpoints import MAX_UNIX_PATH_BYTES, Address, AddressError, bound, connect, listen, parse, prepare_unix_socket, socket_directory


def test_both_forms_parse_and_print_as_grpc_targets(tmp_path: Path) -> None:
    assert parse("127.0.0.1:8080", where="--buffer") == Address(host="127.0.0.1", port=8080)
    assert parse("[::1]:0", where="--buffer").target == "[::1]:0"
    unix = parse(f"unix://{tmp_path}/b.sock", where="--buffer")
    assert unix.is_unix and unix.path == f"{tmp_path}/b.sock"
    assert unix.target == f"unix://{tmp_path}/b.sock"
    assert parse(unix.target, where="x") == unix  # what a server writes, a client reads back
    relative = parse("unix:b.sock", where="x")
    assert relative.path is not None and Path(relative.path).is_absolute()


@pytest.mark.parametrize("bad", ["localhost", "host:port", ":80", "h:70000", "unix:", "unix://"])
def test_a_bad_address_names_the_flag_and_both_forms(bad: str) -> None:
    with pytest.raises(AddressError, match=r"--rollout .*(HOST:PORT|unix:///PATH)"):
        parse(bad, where="--rollout")


def test_a_socket_path_over_the_kernel_limit_is_refused_before_anything_binds(tmp_path: Path) -> None:
    long = tmp_path / ("d" * MAX_UNIX_PATH_BYTES) / "b.sock"
    with pytest.raises(AddressError, match="at most 107 bytes"):
        parse(f"unix://{long}", where="--buffer")


def test_a_stale_socket_is_replaced_and_a_live_one_is_never_stolen(tmp_path: Path) -> None:
    address = parse(f"unix://{tmp_path}/s.sock", where="--listen")
    first = listen(address, where="--listen")
    with pytest.raises(AddressError, match="another process is serving"):
        listen(address, where="--listen")
    first.close()  # the file stays behind, as after kill -9
    assert Path(str(address.path)).exists()
    second = listen(address, where="--listen")
    second.close()
    (tmp_path / "plain").write_text("")
    with pytest.raises(AddressError, match="not a socket"):
        prepare_unix_socket(parse(f"unix://{tmp_path}/plain", where="--listen"), where="--listen")
    with pytest.raises(AddressError, match="does not exist"):
        prepare_unix_socket(parse(f"unix://{tmp_path}/no/s.sock", where="--listen"), where="--listen")


@pytest.mark.parametrize("form", ["unix", "tcp"])
def test_listen_and_connect_carry_bytes_over_either_family(tmp_path: Path, form: str) -> None:
    address = parse(f"unix://{tmp_path}/s.sock" if form == "unix" else "127.0.0.1:0", where="x")
    server = listen(address, where="x")
    actual = bound(server, address)
    assert actual.is_unix or actual.port > 0

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(5)[::-1])

    thread = threading.Thread(target=echo)
    thread.start()
    with connect(actual, timeout=5) as conn:
        conn.sendall(b"hello")
        assert conn.recv(5) == b"olleh"
        assert conn.family == (socket.AF_UNIX if form == "unix" else socket.AF_INET)
    thread.join()
    server.close()


def test_a_run_keeps_its_sockets_in_the_run_directory_unless_the_path_is_too_long(tmp_path: Path) -> None:
    assert socket_directory(tmp_path) == tmp_path / "sockets"
    deep = tmp_path / ("d" * 90)
    chosen = socket_directory(deep)
    assert chosen != deep / "sockets" and chosen.is_dir()
    assert len(str(chosen / "rollout-000.sock")) <= MAX_UNIX_PATH_BYTES
