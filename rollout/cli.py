"""``stoker rollout``: serve generation to the actors over gRPC (``stoker.v1.Rollout``).

    stoker rollout --manifest job.yaml [--weights HOST:PORT|DIR] [--port N] [--max-batch N]
                   [--weights-relay-port P] [--weights-relay-from ADDR ...]
                   [--weights-relay-advertise HOST:PORT] [--weights-relay-stream-port P]
                   [--max-queue N] [--mesh tp=N] [--metrics-port N] [--ready-file F]

On a multi-host slice every host runs this same command (``stoker.distributed`` reads the
topology from the environment): host 0 serves, the others serve only gRPC health and make the
same sampler calls over the one mesh (rollout/hosts.py). If a host is lost the others exit with
``EXIT_PEER_FAILED`` and the JobSet restarts the slice.

``stoker.cli`` imports this module to build its parser, so what loads JAX or gRPC (the sampler,
the server, the weight channel) is imported inside the functions that run once the flags are
checked: ``stoker rollout --help`` and a bad flag answer without them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from concurrent import futures
from typing import Any, NoReturn

from stoker import chips, distributed
from stoker.conversation.tokenization import TokenizerProblem
from stoker.distributed import EXIT_PEER_FAILED, PeerFailure
from stoker.endpoints import Address, AddressError, add_grpc_port, parse, parse_listen, write_ready_file
from stoker.hfconfig import CheckpointError
from stoker.manifest import load_job
from stoker.remote_checkpoint import ROLLOUT

log = logging.getLogger("stoker.rollout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, metavar="FILE", help="RLJob manifest (or the operator's spec file)")
    parser.add_argument("--job", help="the RLJob's name, for logs (default: the manifest's metadata.name)")
    parser.add_argument("--weights", metavar="ADDR_OR_DIR", help="learner weight channel: gRPC host:port or a directory")
    parser.add_argument("--token-file", metavar="F", help="file holding the weight channel's bearer token")
    parser.add_argument(
        "--weights-relay-port", metavar="P|ADDRESS",
        help="serve the sharded weight blocks this server reads to other rollout servers on this port "
        "(or HOST:PORT, or a unix socket unix:///PATH)",
    )
    parser.add_argument(
        "--weights-relay-stream-port", type=int, default=0, metavar="P",
        help="also serve them over the plain-TCP shard stream on this port (default 0: a free one, "
        "advertised with --weights-relay-advertise's host; -1: off, gRPC only)",
    )
    parser.add_argument(
        "--weights-relay-from", metavar="ADDR", action="append", default=[],
        help="read sharded weights from this rollout server's relay first (repeatable; the learner's "
        "servers or the directory for what it cannot give)",
    )
    parser.add_argument(
        "--weights-relay-advertise", metavar="HOST:PORT",
        help="where other servers reach this relay (e.g. $(POD_IP):P, or its unix:///PATH): register with the "
        "learner's weights server for each version and read from the relays it names (needs "
        "--weights-relay-port and --weights ADDRESS)",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    parser.add_argument("--port", type=int, help="gRPC port (default: spec.rollout.port; 0 picks a free one)")
    parser.add_argument(
        "--listen", metavar="ADDRESS", help="serve on HOST:PORT or a unix socket unix:///PATH (instead of --host/--port)"
    )
    parser.add_argument("--max-batch", type=int, help="turns decoded together (default: spec.rollout.maxBatch)")
    parser.add_argument("--max-queue", type=int, help="waiting turns before RESOURCE_EXHAUSTED (default: spec.rollout.maxQueue)")
    parser.add_argument("--session-rows", type=int, help="conversations cached at once (default: 2 x max batch)")
    parser.add_argument("--segment-tokens", type=int, help="decode steps per batching segment (default: 16)")
    parser.add_argument(
        "--mesh", metavar="tp=N",
        help="split the model over N chips, every host's, tensor parallel (default: all of an accelerator's, 1 per host on the CPU)",
    )
    parser.add_argument(
        "--metrics-port", metavar="PORT|ADDRESS", help="serve Prometheus metrics on this port, HOST:PORT or unix:///PATH"
    )
    parser.add_argument(
        "--ready-file", metavar="F", help="write the bound port (a unix socket: its unix:// address) here once serving"
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    job = load_job(args.manifest, fetch=ROLLOUT)  # ManifestError is reported by the dispatcher
    args.job = args.job or job.metadata.name
    for flag in ("max_batch", "max_queue", "session_rows", "segment_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            print(f"stoker rollout: --{flag.replace('_', '-')}: got {value}; expected >= 1", file=sys.stderr)
            return 2
    if (problem := relay_problem(args)) is not None:
        print(f"stoker rollout: {problem}", file=sys.stderr)
        return 2
    token = None
    if args.token_file:
        try:
            with open(args.token_file) as handle:
                token = handle.read().strip()
        except OSError as exc:
            print(f"stoker rollout: --token-file {args.token_file}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    # JAX: only now that the flags are checked (module docstring).
    from stoker.rollout.mesh import MeshError, parse_mesh
    from stoker.rollout.settings import RolloutSettings, make_engine, make_sampler

    try:
        settings = RolloutSettings.from_spec(
            job.spec, max_batch=args.max_batch, max_queue=args.max_queue, session_rows=args.session_rows,
            segment_tokens=args.segment_tokens, port=args.port,
            tensor_parallel=parse_mesh(args.mesh) if args.mesh else None,
        )
        chips.check_free("stoker rollout")  # a held TPU: say who holds it, not libtpu's lockfile error
        topology = distributed.initialize()  # before anything touches a JAX backend
        processes = distributed.Processes.current() if topology else distributed.Processes()
        sampler = make_sampler(settings, processes)
    except (TokenizerProblem, CheckpointError, MeshError, distributed.DistributedEnvError, chips.ChipHeld) as exc:
        print(f"stoker rollout: {exc}", file=sys.stderr)
        return 2
    if not processes.primary:
        return follow_primary(sampler, processes, settings, args, token)
    return serve(make_engine(settings, sampler), settings, args, token)


def serve(engine: Any, settings: Any, args: argparse.Namespace, token: str | None) -> int:
    # JAX and gRPC: run only once the flags are checked (module docstring).
    from stoker.rollout.hosts import LeaderSampler
    from stoker.rollout.server import RolloutServer

    weights = weight_source(args, token)
    address = listen_address(args, settings)
    try:
        server = RolloutServer(
            engine, address=address, weights=weights, weight_poll_seconds=settings.weight_poll_seconds,
            metrics_address=metrics_address(args),
        )
    except (OSError, AddressError) as exc:
        print(f"stoker rollout: cannot serve on {address}: {exc}", file=sys.stderr)
        return 2
    server.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    if args.ready_file:
        write_ready_file(args.ready_file, server.address)
    log.info(
        "rollout for job %s: max batch %d, queue %d, %d session rows, segments of %d tokens, tp=%d, metrics port %s",
        args.job, settings.max_batch, settings.max_queue, settings.session_rows, settings.segment_tokens,
        engine.sampler.mesh.size if engine.sampler.mesh is not None else 1, server.metrics_port,
    )
    server.wait()
    server.stop()
    if engine.failure is not None:
        _peer_failed(str(engine.failure))
    if isinstance(engine.sampler, LeaderSampler):
        try:
            engine.sampler.stop_followers()
        except PeerFailure as exc:
            _peer_failed(str(exc))
    return 0


def follow_primary(sampler: Any, processes: Any, settings: Any, args: argparse.Namespace, token: str | None) -> int:
    """A host other than the primary: gRPC health on the server's port (its pod's probes) while
    it makes the primary's sampler calls, fetching announced weights from the channel itself."""
    # JAX and gRPC: run only once the flags are checked (module docstring).
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from stoker.rollout.hosts import WeightPrefetcher, follow

    subscriber = weight_source(args, token)
    weights = (
        WeightPrefetcher(subscriber, settings.weight_poll_seconds, sampler.weight_layout()).start()
        if subscriber is not None else None
    )
    checks = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    address = listen_address(args, settings)
    try:
        add_grpc_port(server, address, where="--listen")
    except (OSError, AddressError) as exc:
        print(f"stoker rollout: cannot serve health checks on {address}: {exc}", file=sys.stderr)
        return 2
    server.start()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("rollout host %d of %d of job %s follows the primary's sampler calls", processes.index, processes.count, args.job)
    try:
        follow(sampler, processes, weights.fetch if weights is not None else None)
    except PeerFailure as exc:
        _peer_failed(str(exc))
    finally:
        server.stop(0)
        if weights is not None:
            weights.stop()
    return 0


def listen_address(args: argparse.Namespace, settings: Any) -> Address:
    """Where this process serves: ``--listen``, else ``--host``:``--port`` (spec.rollout.port)."""
    return parse(args.listen, where="--listen") if args.listen else Address(host=args.host, port=settings.port)


def metrics_address(args: argparse.Namespace) -> Address | None:
    if args.metrics_port is None:
        return None
    return parse_listen(args.metrics_port, where="--metrics-port", default_host="0.0.0.0")


def relay_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the address and relay flags, if anything (before any model loads)."""
    try:
        if args.listen:
            parse(args.listen, where="--listen")
        metrics_address(args)
        if args.weights_relay_port is not None:
            parse_listen(args.weights_relay_port, where="--weights-relay-port", default_host=args.host)
        for source in args.weights_relay_from:
            parse(source, where="--weights-relay-from")
        if args.weights_relay_advertise is not None:
            parse(args.weights_relay_advertise, where="--weights-relay-advertise")
    except AddressError as exc:
        return str(exc)
    if args.weights_relay_advertise is None:
        return None
    if args.weights_relay_port is None:
        return "--weights-relay-advertise needs --weights-relay-port (the relay it advertises)"
    if not args.weights or args.weights.startswith(("/", ".", "~")) or os.path.isdir(args.weights):
        return "--weights-relay-advertise needs --weights ADDRESS (the learner's server names the relays)"
    return None


def weight_source(args: argparse.Namespace, token: str | None) -> Any:
    """The weight channel's subscriber, relaying sharded weights when asked to."""
    # JAX and gRPC: run only once the flags are checked (module docstring).
    from stoker.weights.channel import make_weight_source
    from stoker.weights.shard_relay import WeightRelay

    if not args.weights:
        return None
    subscriber = make_weight_source(args.weights, token)
    if args.weights_relay_port is not None or args.weights_relay_from:
        advertise = getattr(args, "weights_relay_advertise", None)
        relay = WeightRelay(
            tuple(args.weights_relay_from), auth_token=token, advertise=advertise,
            registry=args.weights if advertise is not None else None,
            stream_port=None if args.weights_relay_stream_port < 0 else args.weights_relay_stream_port,
        )
        if args.weights_relay_port is not None:
            relay.serve(parse_listen(args.weights_relay_port, where="--weights-relay-port", default_host=args.host).target)
        subscriber.relay = relay
    return subscriber


def _peer_failed(message: str) -> NoReturn:
    """Leave now: JAX's shutdown barrier would wait for a host that is gone."""
    print(f"stoker rollout: {message}", file=sys.stderr)
    sys.stderr.flush()
    logging.shutdown()
    os._exit(EXIT_PEER_FAILED)
