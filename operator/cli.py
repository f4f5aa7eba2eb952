"""``stoker operator``: run the kopf operator that reconciles RLJobs."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading

from stoker.buffer.cli import configure_logging  # the project's one JSON log format
from stoker.operator.settings import DEFAULT_IMAGE, DEFAULT_LEARNER_IMAGE, OperatorSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS", help="namespace to watch (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch RLJobs cluster-wide")
    parser.add_argument("--standalone", action="store_true", help="no kopf peering (a single operator replica)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then ~/.kube/config)")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="image of actors, buffer and sandboxes")
    parser.add_argument("--learner-image", default=DEFAULT_LEARNER_IMAGE, help="image of the learner (JAX, TPU)")
    parser.add_argument("--image-pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"])
    parser.add_argument("--status-interval", type=float, default=10.0, metavar="S", help="seconds between observations")
    parser.add_argument(
        "--buffer-address-template",
        default=OperatorSettings.buffer_address_template,
        help="how to reach a job's buffer; fields {name} {namespace} {port}",
    )
    parser.add_argument("--storage-class", default=None, help="StorageClass of the buffer's log volume")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT", help="serve Prometheus metrics here")
    parser.add_argument(
        "--log-format", choices=["text", "json"], default=os.environ.get("STOKER_LOG_FORMAT", "text"),
        help="log lines as text or JSON objects (default: $STOKER_LOG_FORMAT or text)",
    )
    parser.add_argument("--liveness", default=None, metavar="URL", help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--verbose", "-v", action="store_true")


def settings_from_args(args: argparse.Namespace) -> OperatorSettings:
    return OperatorSettings(
        image=args.image,
        learner_image=args.learner_image,
        image_pull_policy=args.image_pull_policy,
        namespaces=tuple(args.namespace),
        all_namespaces=args.all_namespaces,
        standalone=args.standalone,
        kubeconfig=args.kubeconfig,
        status_interval_seconds=args.status_interval,
        buffer_address_template=args.buffer_address_template,
        storage_class=args.storage_class,
        metrics_port=args.metrics_port,
    )


async def run_operator(
    settings: OperatorSettings,
    *,
    stop_flag: asyncio.Event | threading.Event | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
    liveness_endpoint: str | None = None,
) -> None:
    """Run the operator until ``stop_flag`` is set (or forever)."""
    # Here, not at the top: kopf, the Kubernetes client and gRPC (which these modules load) take
    # over half a second that `stoker operator --help` does not need.
    import kopf

    from stoker.operator.bufferstats import StatsReader
    from stoker.operator.handlers import register
    from stoker.operator.kube import Kube, load_configuration
    from stoker.operator.reconcile import Runtime
    from stoker.operator.rolloutstats import RolloutStatsReader

    kube = Kube(load_configuration(settings.kubeconfig), timeout=settings.request_timeout_seconds)
    runtime = Runtime(settings=settings, kube=kube, stats=StatsReader(timeout=settings.stats_timeout_seconds),
                      rollout_stats=RolloutStatsReader(timeout=settings.stats_timeout_seconds))
    metrics_server = None
    if settings.metrics_port is not None:
        from prometheus_client import start_http_server

        metrics_server, _ = start_http_server(settings.metrics_port, registry=runtime.metrics.registry)
        logging.getLogger(__name__).info("metrics on port %d", metrics_server.server_port)
    registry = kopf.OperatorRegistry()
    register(registry, settings)
    try:
        await kopf.operator(
            registry=registry,
            clusterwide=settings.all_namespaces,
            namespaces=list(settings.namespaces),
            standalone=settings.standalone,
            memo=kopf.Memo(runtime=runtime),
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            liveness_endpoint=liveness_endpoint,
        )
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        runtime.stats.close()
        runtime.rollout_stats.close()
        kube.close()


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"stoker operator: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_format, "debug" if args.verbose else "info")
    from kubernetes.config import ConfigException

    try:
        asyncio.run(run_operator(settings, liveness_endpoint=args.liveness))
    except ConfigException as exc:
        print(f"stoker operator: no Kubernetes credentials: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["add_arguments", "main", "run_operator", "settings_from_args"]
