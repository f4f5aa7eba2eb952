"""``stoker buffer``: serve the trajectory buffer.

    stoker buffer --port 50051 --data-dir /data [--token-file F] [--manifest job.yaml]
                  [--ready-file F] [--metrics-port 9090] [--tls-cert C --tls-key K]

Settings come from the RLJob manifest (``spec.buffer`` and ``spec.learner.batchGroups``) or the
spec defaults. ``--port 0`` binds a free port; the bound port is logged and, with
``--ready-file``, written to that file once the server is serving (the local runner waits on it).
``--listen unix:///PATH`` serves on a unix socket instead (no port; hosts without inet sockets).
SIGTERM/SIGINT stop it gracefully: health goes NOT_SERVING, in-flight calls finish, the log is
flushed.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from stoker.buffer.settings import BufferSettings
from stoker.endpoints import Address, AddressError, parse, parse_listen, prepare_unix_socket, write_ready_file
from stoker.manifest import load_job
from stoker.spec import RLJobSpec


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra`` fields."""

    _standard = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in self._standard and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def configure_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=None, help="gRPC port (0 = any free port; default: spec.buffer.port)")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument(
        "--listen", metavar="ADDRESS", help="serve on HOST:PORT or a unix socket unix:///PATH (instead of --host/--port)"
    )
    parser.add_argument("--data-dir", required=True, type=Path, help="directory of the write-ahead log")
    parser.add_argument("--manifest", type=Path, help="RLJob manifest to take the buffer settings from")
    parser.add_argument("--token-file", type=Path, help="file holding the bearer token every call must carry")
    parser.add_argument(
        "--ready-file", type=Path, help="write the bound port (a unix socket: its unix:// address) here once serving"
    )
    parser.add_argument(
        "--metrics-port", metavar="PORT|ADDRESS", help="serve Prometheus metrics on this port (0 = any), HOST:PORT or unix:///PATH"
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address for the metrics endpoint")
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve TLS (with --tls-key)")
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    parser.add_argument("--sync", choices=["batch", "none"], help="override spec.buffer.sync")
    parser.add_argument("--log-format", choices=["json", "text"], default="json")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _fail(message: str) -> int:
    print(f"stoker buffer: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    # Here, not at the top: the gRPC server takes ~0.5 s to import, which `stoker buffer --help` and
    # the operator (it imports this module for configure_logging) should not pay.
    from stoker.buffer.server import BufferServer, TlsFiles

    configure_logging(args.log_format, args.log_level)
    log = logging.getLogger("stoker.buffer")
    spec = load_job(args.manifest).spec if args.manifest else RLJobSpec()  # ManifestError -> exit 2 in stoker.cli
    overrides = {"sync": args.sync} if args.sync else {}
    settings = BufferSettings.from_spec(spec, **overrides)
    token = None
    if args.token_file:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            return _fail(f"--token-file {args.token_file}: cannot read ({exc.strerror or exc})")
        if not token:
            return _fail(f"--token-file {args.token_file}: empty; expected a bearer token")
    tls = None
    if bool(args.tls_cert) != bool(args.tls_key):
        return _fail("--tls-cert and --tls-key go together")
    if args.tls_cert:
        for path in (args.tls_cert, args.tls_key):
            if not path.is_file():
                return _fail(f"{path}: no such file")
        tls = TlsFiles(args.tls_cert, args.tls_key)
    port = spec.buffer.port if args.port is None else args.port
    try:
        address = parse(args.listen, where="--listen") if args.listen else Address(host=args.host, port=port)
        metrics = (
            parse_listen(args.metrics_port, where="--metrics-port", default_host=args.metrics_host)
            if args.metrics_port is not None else None
        )
        prepare_unix_socket(address, where="--listen")
    except AddressError as exc:
        return _fail(str(exc))
    try:
        server = BufferServer(settings, args.data_dir, address=address, token=token, tls=tls, metrics_address=metrics)
    except AddressError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot start on {address}: {exc}")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    log.info(
        "buffer ready",
        extra={"address": str(server.address), "data_dir": str(args.data_dir), "auth": token is not None, "tls": tls is not None},
    )
    if args.ready_file:
        try:
            write_ready_file(args.ready_file, server.address)
        except OSError as exc:
            server.stop(grace=0)
            return _fail(f"--ready-file {args.ready_file}: cannot write ({exc.strerror or exc})")
    stop.wait()
    server.stop()
    log.info("buffer stopped")
    return 0
