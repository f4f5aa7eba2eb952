"""``stoker rollout``: serve generation to the actors over gRPC (``stoker.v1.Rollout``).

    stoker rollout --manifest job.yaml [--weights HOST:PORT|DIR] [--port N] [--max-batch N]
                   [--weights-relay-port P] [--weights-relay-from ADDR ...]
                   [--weights-relay-advertise HOST:PORT] [--weights-relay-stream-port P]
                   [--max-queue N] [--mesh tp=N] [--metrics-port N] [--ready-file F]

On a multi-host slice every host runs this same command (``stoker.distributed`` reads the
topology from the environment): host 0 serves, the others serve only gRPC health and make the
same sampler calls over the one mesh (rollout/hosts.py). If a host is lost the others exit with
``EXIT_PEER_FAILED`` and the JobSet restarts the slice.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any, NoReturn

log = logging.getLogger("stoker.rollout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, metavar="FILE", help="RLJob manifest (or the operator's spec file)")
    parser.add_argument("--job", help="the RLJob's name, for logs (default: the manifest's metadata.name)")
    parser.add_argument("--weights", metavar="ADDR_OR_DIR", help="learner weight channel: gRPC host:port or a directory")
    parser.add_argument("--token-file", metavar="F", help="file holding the weight channel's bearer token")
    parser.add_argument(
        "--weights-relay-port", type=int, metavar="P",
        help="serve the sharded weight blocks this server reads to other rollout servers on this port",
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
        help="where other servers reach this relay (e.g. $(POD_IP):P): register with the learner's weights "
        "server for each version and read from the relays it names (needs --weights-relay-port and --weights HOST:PORT)",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    parser.add_argument("--port", type=int, help="gRPC port (default: spec.rollout.port; 0 picks a free one)")
    parser.add_argument("--max-batch", type=int, help="turns decoded together (default: spec.rollout.maxBatch)")
    parser.add_argument("--max-queue", type=int, help="waiting turns before RESOURCE_EXHAUSTED (default: spec.rollout.maxQueue)")
    parser.add_argument("--session-rows", type=int, help="conversations cached at once (default: 2 x max batch)")
    parser.add_argument("--segment-tokens", type=int, help="decode steps per batching segment (default: 16)")
    parser.add_argument(
        "--mesh", metavar="tp=N",
        help="split the model over N chips, every host's, tensor parallel (default: all of an accelerator's, 1 per host on the CPU)",
    )
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--ready-file", metavar="F", help="write the bound port here once serving")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def main(args: argparse.Namespace) -> int:
    from stoker.remote_checkpoint import ROLLOUT
    from stoker.manifest import load_job

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
    from stoker import distributed
    from stoker.actor.tokenization import TokenizerProblem
    from stoker.model.hf import CheckpointError
    from stoker.rollout.mesh import MeshError, parse_mesh
    from stoker.rollout.settings import RolloutSettings, make_engine, make_sampler

    try:
        settings = RolloutSettings.from_spec(
            job.spec, max_batch=args.max_batch, max_queue=args.max_queue, session_rows=args.session_rows,
            segment_tokens=args.segment_tokens, port=args.port,
            tensor_parallel=parse_mesh(args.mesh) if args.mesh else None,
        )
        topology = distributed.initialize()  # before anything touches a JAX backend
        processes = distributed.Processes.current() if topology else distributed.Processes()
        sampler = make_sampler(settings, processes)
    except (TokenizerProblem, CheckpointError, MeshError, distributed.DistributedEnvError) as exc:
        print(f"stoker rollout: {exc}", file=sys.stderr)
        return 2
    if not processes.primary:
        return follow_primary(sampler, processes, settings, args, token)
    return serve(make_engine(settings, sampler), settings, args, token)


def serve(engine: Any, settings: Any, args: argparse.Namespace, token: str | None) -> int:
    from stoker.buffer.server import write_ready_file
    from stoker.distributed import PeerFailure
    from stoker.rollout.hosts import LeaderSampler
    from stoker.rollout.server import RolloutServer

    weights = weight_source(args, token)
    try:
        server = RolloutServer(
            engine, host=args.host, port=settings.port, weights=weights,
            weight_poll_seconds=settings.weight_poll_seconds, metrics_port=args.metrics_port,
        )
    except OSError as exc:
        print(f"stoker rollout: cannot serve on {args.host}:{settings.port}: {exc}", file=sys.stderr)
        return 2
    server.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    if args.ready_file:
        write_ready_file(args.ready_file, server.port)
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
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from stoker.distributed import PeerFailure
    from stoker.rollout.hosts import WeightPrefetcher, follow

    subscriber = weight_source(args, token)
    weights = (
        WeightPrefetcher(subscriber, settings.weight_poll_seconds, sampler.weight_layout()).start()
        if subscriber is not None else None
    )
    checks = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    if server.add_insecure_port(f"{args.host}:{settings.port}") == 0:
        print(f"stoker rollout: cannot serve health checks on {args.host}:{settings.port}", file=sys.stderr)
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


def relay_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the relay flags, if anything."""
    advertise = args.weights_relay_advertise
    if advertise is None:
        return None
    if args.weights_relay_port is None:
        return "--weights-relay-advertise needs --weights-relay-port (the relay it advertises)"
    if not args.weights or args.weights.startswith(("/", ".", "~")) or os.path.isdir(args.weights):
        return "--weights-relay-advertise needs --weights HOST:PORT (the learner's server names the relays)"
    host, _, port = advertise.rpartition(":")
    if not host or not port.isdigit():
        return f"--weights-relay-advertise {advertise}: expected HOST:PORT"
    return None


def weight_source(args: argparse.Namespace, token: str | None) -> Any:
    """The weight channel's subscriber, relaying sharded weights when asked to."""
    from stoker.actor.wiring import make_weight_source

    if not args.weights:
        return None
    subscriber = make_weight_source(args.weights, token)
    if args.weights_relay_port is not None or args.weights_relay_from:
        from stoker.model.shard_relay import WeightRelay

        advertise = getattr(args, "weights_relay_advertise", None)
        relay = WeightRelay(
            tuple(args.weights_relay_from), auth_token=token, advertise=advertise,
            registry=args.weights if advertise is not None else None,
            stream_port=None if args.weights_relay_stream_port < 0 else args.weights_relay_stream_port,
        )
        if args.weights_relay_port is not None:
            relay.serve(f"{args.host}:{args.weights_relay_port}")
        subscriber.relay = relay
    return subscriber


def _peer_failed(message: str) -> NoReturn:
    """Leave now: JAX's shutdown barrier would wait for a host that is gone."""
    from stoker.distributed import EXIT_PEER_FAILED

    print(f"stoker rollout: {message}", file=sys.stderr)
    sys.stderr.flush()
    logging.shutdown()
    os._exit(EXIT_PEER_FAILED)
